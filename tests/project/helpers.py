"""Builders for project folders in tests: a valid project, and the same project with keys changed."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml

from lightning_dagster.project.splits import SPLITS

DELETE = object()

HOOKS = """
VALUE = 3


def judge(task, transcript):
    return 1.0


def run(task, client):
    return 1.0


class Agent:
    def run(self):
        return None
"""

BASE: dict[str, Any] = {
    "name": "demo",
    "harness": {"command": ["python", "agent.py"]},
    "tasks": {"path": "tasks.jsonl"},
}


def task_rows(per_split: int = 3) -> list[dict[str, Any]]:
    """`per_split` rows for each split, families alternating."""
    return [
        {"task_id": f"{split}-{i}", "family": "ab"[i % 2], "split": split, "question": f"q{i}", "answer": i}
        for split in SPLITS
        for i in range(per_split)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def set_key(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    if value is DELETE:
        del data[last]
    else:
        data[last] = value


def write_project(folder: Path, changes: dict[str, Any] | None = None, rows: list | None = None) -> Path:
    """A valid project in `folder` (agent.py, hooks.py, broken.py, tasks.jsonl), with `changes`
    ({dotted key: value or DELETE}) applied to its project file; `rows` replace tasks.jsonl, which is
    otherwise written only when missing. Returns the project file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "agent.py").write_text("print('agent')\n")
    (folder / "hooks.py").write_text(HOOKS)
    (folder / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    if rows is not None or not (folder / "tasks.jsonl").exists():
        write_jsonl(folder / "tasks.jsonl", task_rows() if rows is None else rows)
    data = copy.deepcopy(BASE)
    for dotted, value in (changes or {}).items():
        set_key(data, dotted, value)
    file = folder / "lightning-dagster.yaml"
    file.write_text(yaml.safe_dump(data))
    return file
