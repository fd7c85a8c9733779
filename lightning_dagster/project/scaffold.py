"""`lightning-dagster init DIR`: write a working starter project (project file, agent, tasks) into DIR.
Exit status: 0 written, 2 DIR is not an empty folder."""

from __future__ import annotations

import argparse
import json
import random
import sys
from importlib import resources
from pathlib import Path
from typing import Any

STARTER_FILES = ("lightning-dagster.yaml", "agent.py")
STARTER_TASKS = 200
# Per 20 tasks: 14 train, 4 holdout, 1 protected, 1 canary.
SPLIT_CYCLE = ["train"] * 14 + ["holdout"] * 4 + ["protected", "canary"]
OPERATIONS = {"add": "+", "subtract": "-", "multiply": "*"}


def starter_tasks(n: int = STARTER_TASKS) -> list[dict[str, Any]]:
    """`n` arithmetic tasks, the same every time, every split getting every family."""
    rng = random.Random(0)
    families = list(OPERATIONS)
    tasks = []
    for i in range(n):
        family = families[i % len(families)]
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        answer = {"add": a + b, "subtract": a - b, "multiply": a * b}[family]
        tasks.append(
            {
                "task_id": f"arith-{i:03d}",
                "family": family,
                "split": SPLIT_CYCLE[i % len(SPLIT_CYCLE)],
                "question": f"What is {a} {OPERATIONS[family]} {b}?",
                "answer": answer,
            }
        )
    return tasks


def write_starter(folder: Path) -> list[Path]:
    """Write the starter project into an empty or new `folder`; returns the files written."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} is not an empty folder; init writes only into a new or empty one")
    folder.mkdir(parents=True, exist_ok=True)
    starter = resources.files("lightning_dagster.project.starter")
    written = []
    for name in STARTER_FILES:
        (folder / name).write_text(starter.joinpath(name).read_text())
        written.append(folder / name)
    tasks_file = folder / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(task) + "\n" for task in starter_tasks()))
    return [*written, tasks_file]


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", type=Path, help="folder to create (or an empty one)")
    parser.set_defaults(handler=_init)


def _init(args: argparse.Namespace) -> int:
    try:
        written = write_starter(args.dir)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {path}" for path in written))
    print(f"next: lightning-dagster project check --project {args.dir}")
    return 0
