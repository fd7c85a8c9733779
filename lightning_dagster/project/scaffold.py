"""`lightning-dagster init DIR`: write a working starter project (project file, agent, tasks, demonstrations)
into DIR. Exit status: 0 written, 2 DIR is not an empty folder."""

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
STARTER_TASKS = 1000
SYSTEM_PROMPT = "Reply with the sum or difference to compute, like 12+7."  # agent.py's
NAMES = ("Ann", "Bo", "Cy", "Dee", "Eve", "Max")
ITEMS = ("apples", "pens", "cards", "coins")


def _problem(rng: random.Random) -> tuple[str, str, str, int]:
    """(family, question, expression, answer): a two-digit sum or difference told as a story."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    if rng.random() < 0.5:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return "add", f"{name} has {a} {item} and gets {b} more. How many now?", f"{a}+{b}", a + b
    a = rng.randint(30, 99)
    b = rng.randint(10, a - 1)
    return "subtract", f"{name} has {a} {item} and gives away {b}. How many left?", f"{a}-{b}", a - b


def starter_tasks() -> list[dict[str, Any]]:
    """`STARTER_TASKS` distinct word problems, the same every time. The agent asks for the expression and
    computes it: a tiny warm-started model then generalizes to unseen stories, so RL has rewards that differ
    within a group (asked for the number, it learns train's answers by heart)."""
    rng, seen, tasks = random.Random(0), set(), []
    while len(tasks) < STARTER_TASKS:
        family, question, expression, answer = _problem(rng)
        if question in seen:
            continue
        seen.add(question)
        i = len(tasks)
        tasks.append({
            "task_id": f"story-{i:04d}", "family": family, "split": SPLIT_CYCLE[i % len(SPLIT_CYCLE)],
            "question": question, "expression": expression, "answer": answer,
        })  # fmt: skip
    return tasks


def demonstration(task: dict[str, Any]) -> dict[str, Any]:
    """The ideal episode of `task` as agent.py would have it: its question, the expression alone."""
    return {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": task["expression"]},
        ]
    }


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
