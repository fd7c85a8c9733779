"""The project's tasks (`.jsonl`, `.csv`, `.parquet`), split four ways: each a JSON-able dict of its row plus
`task_id`, `family` and `split`; `content_hash` covers them sorted by id. Messages count rows from 1."""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lightning_dagster.project.config import Project
from lightning_dagster.project.errors import TaskDataError, TaskFieldConflict
from lightning_dagster.project.splits import SPLITS, UnknownSplit, content_hash, split_of

SHOWN = 3  # offending ids or rows named in one message
KINDS = {list: "array", str: "string", bool: "boolean", type(None): "null"}  # a JSON value's (else number)
Rows = tuple[list[str], list[dict[str, Any]]]  # the columns in order, and each row's values by column


class _BadLines(ValueError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def _shown(items: list[str], what: str) -> list[str]:
    """The first SHOWN items, then one counting the rest (`what` they are)."""
    return items[:SHOWN] + ([f"and {len(items) - SHOWN} more {what}"] if len(items) > SHOWN else [])


def _not_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON (write null, or the number as a string)")


def _read_jsonl(path: Path, text_columns: list[str]) -> Rows:
    """One JSON object a line, values as JSON typed them; blank lines skipped, bad ones in `_BadLines`."""
    columns: dict[str, None] = {}
    records: list[dict[str, Any]] = []
    bad: list[str] = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
        except UnicodeDecodeError as err:
            bad.append(f"line {number}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})")
            continue
        if not line:
            continue
        try:
            value = json.loads(line, parse_constant=_not_json_constant)
        except json.JSONDecodeError as err:
            bad.append(f"line {number}: not valid JSON ({err.msg} at column {err.colno})")
            continue
        except ValueError as err:  # NaN and the infinities, refused by `_not_json_constant`
            bad.append(f"line {number}: {err}")
            continue
        if not isinstance(value, dict):
            kind = KINDS.get(type(value), "number")
            bad.append(f"line {number}: a JSON {kind}, expected an object (one task a line)")
            continue
        columns.update(dict.fromkeys(value))
        records.append(value)
    if bad:
        raise _BadLines(_shown(bad, "bad lines"))
    return list(columns), [{column: row.get(column) for column in columns} for row in records]


def _records(frame: pd.DataFrame) -> Rows:
    return [str(column) for column in frame.columns], frame.to_dict(orient="records")


# Nullable dtypes: an integer column with a missing value stays integers (with None), not floats.
def _read_csv(path: Path, text_columns: list[str]) -> Rows:
    dtypes = {column: str for column in text_columns}  # ids such as `007` must not become the number 7
    return _records(pd.read_csv(path, dtype=dtypes, dtype_backend="numpy_nullable"))


def _read_parquet(path: Path, text_columns: list[str]) -> Rows:
    return _records(pd.read_parquet(path, dtype_backend="numpy_nullable"))


READERS: dict[str, Callable[[Path, list[str]], Rows]] = {
    ".jsonl": _read_jsonl,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
}


@dataclass(frozen=True)
class TaskSet:
    """Tasks per split (every split of SPLITS is a key) and the hash of the whole set."""

    file: Path
    splits: dict[str, list[dict[str, Any]]]
    content_hash: str
    split_key: str  # the project key the split comes from, for messages

    def __len__(self) -> int:
        return sum(len(tasks) for tasks in self.splits.values())

    def families(self, split: str) -> Counter[str]:
        return Counter(task["family"] for task in self.splits[split])

    def draw(self, split: str, n: int, seed: int, *, exclude: Collection[str] = ()) -> list[dict[str, Any]]:
        """`n` tasks of `split` drawn with `seed`, none in `exclude` (only train repeats, to give `n`)."""
        if split not in SPLITS:
            raise UnknownSplit(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        excluded = frozenset(exclude)
        rows = [task for task in self.splits[split] if task["task_id"] not in excluded]
        if split != "train" or not rows:
            n = min(n, len(rows))
        drawn: list[dict[str, Any]] = []
        passes = 0
        while len(drawn) < n:
            drawn += sorted(rows, key=lambda task: _seeded_rank(seed, passes, task["task_id"]))
            passes += 1
        return drawn[:n]

    def require_splits(self, needed: Iterable[str]) -> None:
        """Raise TaskDataError naming every split in `needed` that has no task."""
        needed = list(needed)
        unknown = [name for name in needed if name not in SPLITS]
        if unknown:
            raise UnknownSplit(f"unknown splits {unknown}; expected some of {', '.join(SPLITS)}")
        empty = [name for name in needed if not self.splits[name]]
        if empty:
            problem = f"no tasks in split {', '.join(empty)} (this run needs {', '.join(needed)})"
            raise TaskDataError(self.file, [(self.split_key, problem)])


def _seeded_rank(seed: int, passes: int, task_id: str) -> str:
    return hashlib.sha256(f"{seed}:{passes}:{task_id}".encode()).hexdigest()


def _plain(value: Any) -> Any:
    """pandas/numpy values as plain Python: arrays as lists, numpy scalars unboxed, NaN/NA/NaT as None."""
    if isinstance(value, np.ndarray):
        return [_plain(item) for item in value.tolist()]
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, np.generic):
        return _plain(value.item())
    if value is None or value is pd.NA or value is pd.NaT:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _json_problem(row: dict[str, Any], number: int) -> str | None:
    try:
        json.dumps(row, allow_nan=False)
        return None
    except (TypeError, ValueError):
        pass
    for column, value in row.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            return (
                f"row {number}, column {column!r}: {type(value).__name__} {value!r} is not JSON-serializable"
            )
    return f"row {number}: not JSON-serializable"


def _rows_text(numbers: list[int]) -> str:
    shown = ", ".join(map(str, numbers[:SHOWN]))
    return f"rows {shown}" + (f" and {len(numbers) - SHOWN} more" if len(numbers) > SHOWN else "")


def _key_value(value: Any) -> bool:
    """Whether `value` can be a task id, family or split: text, a number or missing."""
    return value is None or (isinstance(value, str | int | float) and not isinstance(value, bool))


def key_text(value: Any) -> str | None:
    """A task id, family or split value as the loader keeps it: text, a whole float without its `.0`."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _read(project: Project) -> Rows:
    spec, path = project.tasks, project.tasks.path
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        problem = f"unsupported file type {path.suffix or '(none)'!r}; use one of {', '.join(READERS)}"
        raise TaskDataError(path, [("tasks.path", problem)])
    text_columns = [c for c in (spec.id_column, spec.family_column, spec.split_column) if c]
    try:
        return reader(path, text_columns)
    except _BadLines as err:
        problems = [("tasks.path", f"cannot read as jsonl: {problem}") for problem in err.problems]
        raise TaskDataError(path, problems) from None
    except Exception as err:  # pandas and pyarrow raise many types for one cause: the file does not parse
        problem = f"cannot read as {path.suffix[1:]}: {type(err).__name__}: {err}"
        raise TaskDataError(path, [("tasks.path", problem)]) from None


def _keyed(project: Project) -> list[tuple[str, str]]:
    """(project key, column) of the columns the task id, family and split are read from."""
    spec = project.tasks
    keys = [("tasks.id_column", spec.id_column), ("tasks.family_column", spec.family_column)]
    return keys + ([("tasks.split_column", spec.split_column)] if spec.split_column else [])


def _check_columns(project: Project, columns: list[str]) -> None:
    spec = project.tasks
    available = f"(columns: {', '.join(columns) or 'none'})"
    missing = [
        (key, f"no column {column!r} {available}") for key, column in _keyed(project) if column not in columns
    ]
    if missing:
        raise TaskDataError(spec.path, missing)
    unmapped = [
        (f"harness.env_map.{name}", f"no column {column!r} in {spec.path} {available}")
        for name, column in project.harness.env_map.items()
        if column not in columns
    ]
    if unmapped:
        raise TaskDataError(project.file, unmapped)


def _sources(project: Project) -> dict[str, tuple[str | None, str]]:
    """Each loader-set field: its column (None: computed) and how a message names it."""
    spec = project.tasks
    split = (
        (spec.split_column, f"column {spec.split_column!r} (tasks.split_column)")
        if spec.split_column
        else (None, "tasks.split_fractions (a hash of the task id)")
    )
    return {
        "task_id": (spec.id_column, f"column {spec.id_column!r} (tasks.id_column)"),
        "family": (spec.family_column, f"column {spec.family_column!r} (tasks.family_column)"),
        "split": split,
    }


def _conflicts(
    row: dict[str, Any], number: int, task: dict[str, Any], sources: dict
) -> list[tuple[str, str]]:
    """A (field, message) for each loader-set field whose same-named column in `row` holds another value."""
    found = []
    for field, (column, source) in sources.items():
        if column == field or row.get(field) is None:
            continue
        own = row[field]
        if (key_text(own) if _key_value(own) else own) != task[field]:
            found.append(
                (
                    field,
                    f"task {task['task_id']!r} (row {number}): column {field!r} holds {own!r}, but the loader "
                    f"sets {field} to {task[field]!r} from {source}; rename the column, or make it the source",
                )
            )
    return found


def load_tasks(project: Project) -> TaskSet:
    """Read, check and split the project's tasks; raises TaskDataError naming the column and rows."""
    spec = project.tasks
    columns, records = _read(project)
    if not records:
        raise TaskDataError(spec.path, [("tasks.path", "the file has no task rows")])
    _check_columns(project, columns)
    split_key = "tasks.split_column" if spec.split_column else "tasks.split_fractions"
    weights = {name: share for name, share in (spec.split_fractions or {}).items() if share > 0}
    problems: list[tuple[str, str]] = []
    no_id: list[int] = []
    no_family: list[int] = []
    bad_split: dict[str, list[int]] = defaultdict(list)
    rows_of: dict[str, list[int]] = defaultdict(list)
    not_text: dict[tuple[str, str], list[int]] = defaultdict(list)
    keyed = _keyed(project)
    tasks: list[dict[str, Any]] = []
    sources = _sources(project)
    conflicts: dict[str, list[str]] = defaultdict(list)
    for number, record in enumerate(records, start=1):
        row = {str(column): _plain(value) for column, value in record.items()}
        json_problem = _json_problem(row, number)
        if json_problem:
            problems.append(("tasks.path", json_problem))
            continue
        wrong = [(key, column) for key, column in keyed if not _key_value(row[column])]
        for key_column in wrong:
            not_text[key_column].append(number)
        if wrong:
            continue
        task_id, family = key_text(row[spec.id_column]), key_text(row[spec.family_column])
        if not task_id:
            no_id.append(number)
            continue
        rows_of[task_id].append(number)
        if not family:
            no_family.append(number)
        split = key_text(row[spec.split_column]) if spec.split_column else split_of(task_id, weights)
        if split not in SPLITS:
            bad_split[str(split)].append(number)
        task = {**row, "task_id": task_id, "family": family, "split": split}
        for field, message in _conflicts(row, number, task, sources):
            conflicts[field].append(message)
        tasks.append(task)
    for (key, column), rows in not_text.items():
        problems.append((key, f"{column!r} is not text or a number in {_rows_text(rows)}"))
    if no_id:
        problems.append(("tasks.id_column", f"{spec.id_column!r} is empty in {_rows_text(no_id)}"))
    duplicates = [(task_id, rows) for task_id, rows in rows_of.items() if len(rows) > 1]
    if duplicates:
        shown = ", ".join(f"{task_id!r} ({_rows_text(rows)})" for task_id, rows in duplicates[:SHOWN])
        more = f" and {len(duplicates) - SHOWN} more" if len(duplicates) > SHOWN else ""
        problems.append(("tasks.id_column", f"duplicate task ids in {spec.id_column!r}: {shown}{more}"))
    if no_family:
        problems.append(
            ("tasks.family_column", f"{spec.family_column!r} is empty in {_rows_text(no_family)}")
        )
    for value, rows in bad_split.items():
        problem = f"{value!r} in {_rows_text(rows)} is not a split; use {', '.join(SPLITS)}"
        problems.append((split_key, problem))
    for field, messages in conflicts.items():
        problems.append((field, "; ".join(_shown(messages, f"task(s) with another {field}"))))
    if problems:
        raise (TaskFieldConflict if conflicts else TaskDataError)(spec.path, problems)
    tasks.sort(key=lambda task: task["task_id"])
    return TaskSet(
        file=spec.path,
        splits={name: [task for task in tasks if task["split"] == name] for name in SPLITS},
        content_hash=content_hash({"tasks": tasks}),
        split_key=split_key,
    )
