"""`lightning-dagster init DIR`: write a working starter project (project file, agent, tasks, demonstrations)
into DIR.
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
# Per 20 tasks: 14 train, 4 holdout, 1 protected, 1 canary.
SPLIT_CYCLE = ["train"] * 14 + ["holdout"] * 4 + ["protected", "canary"]
OPERATIONS = {"add": "+", "subtract": "-"}
SYSTEM_PROMPT = "Reply with the number only."  # agent.py's


def starter_tasks() -> list[dict[str, Any]]:
    """Every single-digit sum and difference (a >= b), shuffled the same way every time, every split getting
    both families: small enough that the embedded model, warm-started on the train split's demonstrations,
    solves some of them and RL has rewards that differ within a group to learn from."""
    pairs = [
        (f, a, b) for a in range(1, 10) for b in range(1, 10) for f in OPERATIONS if f == "add" or a >= b
    ]
    random.Random(0).shuffle(pairs)
    return [
        {
            "task_id": f"arith-{i:03d}",
            "family": family,
            "split": SPLIT_CYCLE[i % len(SPLIT_CYCLE)],
            "question": f"What is {a} {OPERATIONS[family]} {b}?",
            "answer": a + b if family == "add" else a - b,
        }
        for i, (family, a, b) in enumerate(pairs)
    ]


def demonstration(task: dict[str, Any]) -> dict[str, Any]:
    """The ideal episode of `task` as agent.py would have it: its question, the answer alone."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": str(task["answer"])},
        ]
    }


def write_starter(folder: Path) -> list[Path]:
    """Write the starter project into an empty or new `folder`: the project file, agent.py, tasks.jsonl and
    demos.jsonl (the train split's ideal episodes, the warm start's); returns the files written."""
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} is not an empty folder; init writes only into a new or empty one")
    folder.mkdir(parents=True, exist_ok=True)
    starter = resources.files("lightning_dagster.project.starter")
    written = []
    for name in STARTER_FILES:
        (folder / name).write_text(starter.joinpath(name).read_text())
        written.append(folder / name)
    tasks = starter_tasks()
    train = [demonstration(t) for t in tasks if t["split"] == "train"]
    for name, rows in (("tasks.jsonl", tasks), ("demos.jsonl", train)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        written.append(folder / name)
    return written


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
