"""Tasks through pandas: the three formats read the same tasks, the hash ignores row order, hash splits
follow the fractions, and every bad file is a TaskDataError naming the file, key, column and rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pandas as pd
import pytest

from lightning_dagster.project import ProjectError, TaskDataError, TaskFieldConflict, load_project, load_tasks
from lightning_dagster.project.splits import SPLITS
from tests.project.helpers import task_rows, write_jsonl, write_project

ROWS = [
    {
        "task_id": "007",
        "family": "add",
        "split": "train",
        "question": "2+5?",
        "answer": 7,
        "weight": 0.5,
        "note": None,
    },
    {
        "task_id": "12",
        "family": "mul",
        "split": "holdout",
        "question": "3*4?",
        "answer": 12,
        "weight": 1.0,
        "note": "x",
    },
    {
        "task_id": "a9",
        "family": "add",
        "split": "protected",
        "question": "1+1?",
        "answer": 2,
        "weight": 2.5,
        "note": None,
    },
    {
        "task_id": "b3",
        "family": "mul",
        "split": "canary",
        "question": "2*2?",
        "answer": 4,
        "weight": 0.25,
        "note": "y",
    },
]


def _project(tmp_path: Path, tasks_file: str, rows=None, **tasks_keys):
    changes = {"tasks.path": tasks_file, **{f"tasks.{k}": v for k, v in tasks_keys.items()}}
    return load_project(write_project(tmp_path, changes, rows))


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_every_format_reads_the_same_plain_tasks(tmp_path, fmt):
    frame = pd.DataFrame(ROWS)
    path = tmp_path / f"tasks.{fmt}"
    tmp_path.mkdir(exist_ok=True)
    {
        "jsonl": lambda: write_jsonl(path, ROWS),
        "csv": lambda: frame.to_csv(path, index=False),
        "parquet": lambda: frame.to_parquet(path),
    }[fmt]()
    tasks = load_tasks(_project(tmp_path, path.name))
    assert {split: [t["task_id"] for t in tasks.splits[split]] for split in SPLITS} == {
        "train": ["007"],
        "holdout": ["12"],
        "protected": ["a9"],
        "canary": ["b3"],
    }
    assert tasks.splits["train"] == [ROWS[0]]
    assert tasks.splits["holdout"] == [ROWS[1]]
    assert json.loads(json.dumps(tasks.splits["canary"][0])) == ROWS[3]
    # The hash is the same whichever format carried the rows.
    reference = load_tasks(_project(tmp_path / "ref", "tasks.jsonl", ROWS))
    assert tasks.content_hash == reference.content_hash


def test_parquet_lists_come_back_as_plain_lists(tmp_path):
    tmp_path.mkdir(exist_ok=True)
    rows = [{**row, "steps": [1, 2, row["answer"]]} for row in ROWS]
    pd.DataFrame(rows).to_parquet(tmp_path / "tasks.parquet")
    tasks = load_tasks(_project(tmp_path, "tasks.parquet"))
    assert tasks.splits["train"][0]["steps"] == [1, 2, 7]
    assert type(tasks.splits["train"][0]["steps"][0]) is int


def test_the_configured_columns_become_task_id_family_and_split(tmp_path):
    rows = [{"ident": i, "kind": "k", "part": split} for i, split in enumerate(SPLITS)]
    tasks = load_tasks(
        _project(tmp_path, "tasks.jsonl", rows, id_column="ident", family_column="kind", split_column="part")
    )
    assert tasks.splits["holdout"] == [
        {"ident": 1, "kind": "k", "part": "holdout", "task_id": "1", "family": "k", "split": "holdout"}
    ]


def test_a_column_named_like_a_loader_field_with_another_value_is_refused_naming_task_and_field(tmp_path):
    rows = [
        {"ident": f"t{i}", "kind": "k", "part": split, "task_id": f"t{i}", "family": "k", "split": split}
        for i, split in enumerate(SPLITS)
    ]
    rows[1]["task_id"] = "other-id"  # the loader would have replaced it with t1
    rows[2]["family"] = "other-family"
    keys = {"id_column": "ident", "family_column": "kind", "split_column": "part"}
    with pytest.raises(TaskFieldConflict) as caught:
        load_tasks(_project(tmp_path, "tasks.jsonl", rows, **keys))
    assert isinstance(caught.value, TaskDataError) and caught.value.keys == ["task_id", "family"]
    message = str(caught.value)
    assert (
        "task_id: task 't1' (row 2): column 'task_id' holds 'other-id', but the loader sets task_id to 't1' "
        "from column 'ident' (tasks.id_column)" in message
    )
    assert (
        "family: task 't2' (row 3): column 'family' holds 'other-family', but the loader sets family to 'k' "
        "from column 'kind' (tasks.family_column)" in message
    )


def test_a_split_column_that_disagrees_with_split_fractions_is_refused(tmp_path):
    rows = [{"task_id": f"t{i}", "family": "f"} for i in range(40)]
    tasks = load_tasks(_project(tmp_path / "a", "tasks.jsonl", rows, split_fractions=FRACTIONS))
    hashed = {t["task_id"]: t["split"] for split in SPLITS for t in tasks.splits[split]}
    # the same split written in the file agrees: loaded as before
    agreeing = [{**row, "split": hashed[row["task_id"]]} for row in rows]
    again = load_tasks(_project(tmp_path / "b", "tasks.jsonl", agreeing, split_fractions=FRACTIONS))
    assert {t["task_id"]: t["split"] for s in SPLITS for t in again.splits[s]} == hashed
    disagreeing = [dict(row) for row in agreeing]
    disagreeing[5]["split"] = "canary" if hashed["t5"] != "canary" else "train"
    with pytest.raises(TaskFieldConflict, match=r"split: task 't5' \(row 6\): column 'split' holds '\w+', but "
                       r"the loader sets split to '\w+' from tasks.split_fractions"):  # fmt: skip
        load_tasks(_project(tmp_path / "c", "tasks.jsonl", disagreeing, split_fractions=FRACTIONS))


def test_equal_values_and_missing_ones_in_same_named_columns_are_no_conflict(tmp_path):
    rows = [
        {"ident": i, "kind": "k", "split": split, "task_id": i, "family": None}
        for i, split in enumerate(SPLITS)
    ]
    tasks = load_tasks(_project(tmp_path, "tasks.jsonl", rows, id_column="ident", family_column="kind"))
    # 1 (a number) and "1" are the same id, as the loader reads ids; a missing family is filled in
    assert tasks.splits["holdout"] == [
        {"ident": 1, "kind": "k", "split": "holdout", "task_id": "1", "family": "k"}
    ]


def test_the_hash_ignores_row_order_and_sees_any_changed_value(tmp_path):
    rows = task_rows(5)
    shuffled = list(rows)
    random.Random(1).shuffle(shuffled)
    changed = [dict(row) for row in rows]
    changed[7]["answer"] = 999
    hashes = [
        load_tasks(_project(tmp_path / name, "tasks.jsonl", r)).content_hash
        for name, r in [("a", rows), ("b", shuffled), ("c", changed)]
    ]
    assert hashes[0] == hashes[1]
    assert hashes[0] != hashes[2]


FRACTIONS = {"train": 0.7, "holdout": 0.2, "protected": 0.05, "canary": 0.05}


def test_hash_splits_follow_the_fractions_and_depend_only_on_the_task_id(tmp_path):
    rows = [{"task_id": f"t{i}", "family": "f"} for i in range(4000)]
    tasks = load_tasks(_project(tmp_path / "a", "tasks.jsonl", rows, split_fractions=FRACTIONS))
    for split, share in FRACTIONS.items():
        assert abs(len(tasks.splits[split]) / len(rows) - share) < 0.02, split
    # Another file with a subset of the ids, in another order, puts each id in the same split.
    subset = rows[::-7]
    again = load_tasks(_project(tmp_path / "b", "tasks.jsonl", subset, split_fractions=FRACTIONS))
    where = {t["task_id"]: split for split in SPLITS for t in tasks.splits[split]}
    assert all(where[t["task_id"]] == split for split in SPLITS for t in again.splits[split])
    assert len(again) == len(subset)


def test_a_zero_fraction_split_gets_no_task(tmp_path):
    rows = [{"task_id": f"t{i}", "family": "f"} for i in range(500)]
    fractions = {"train": 0.8, "holdout": 0.2, "protected": 0.0}
    tasks = load_tasks(_project(tmp_path, "tasks.jsonl", rows, split_fractions=fractions))
    assert tasks.splits["protected"] == [] and tasks.splits["canary"] == []
    assert len(tasks.splits["train"]) + len(tasks.splits["holdout"]) == 500


def test_require_splits_names_the_empty_ones(tmp_path):
    rows = [row for row in task_rows() if row["split"] != "canary"]
    tasks = load_tasks(_project(tmp_path, "tasks.jsonl", rows))
    tasks.require_splits(["train", "holdout", "protected"])
    with pytest.raises(TaskDataError, match="no tasks in split canary") as caught:
        tasks.require_splits(SPLITS)
    assert caught.value.file == tmp_path / "tasks.jsonl"
    assert caught.value.keys == ["tasks.split_column"]


def _with(rows, index, **values):
    rows = [dict(row) for row in rows]
    rows[index].update(values)
    return rows


GOOD = task_rows()


@pytest.mark.parametrize(
    ("write", "keys", "key", "fragments"),
    [
        (
            lambda p: p.with_suffix(".jsonl").write_text('{"task_id": 1}\n{oops\n'),
            {},
            "tasks.path",
            ["cannot read as jsonl"],
        ),
        (
            lambda p: p.with_suffix(".parquet").write_text("not parquet"),
            {"path": "tasks.parquet"},
            "tasks.path",
            ["cannot read as parquet"],
        ),
        (
            lambda p: p.with_suffix(".txt").write_text("x"),
            {"path": "tasks.txt"},
            "tasks.path",
            ["unsupported file type '.txt'", ".jsonl, .csv, .parquet"],
        ),
        (
            lambda p: write_jsonl(p, GOOD),
            {"id_column": "ident"},
            "tasks.id_column",
            ["no column 'ident'", "columns: task_id, family, split"],
        ),
        (
            lambda p: write_jsonl(p, GOOD),
            {"family_column": "kind"},
            "tasks.family_column",
            ["no column 'kind'"],
        ),
        (
            lambda p: write_jsonl(p, GOOD),
            {"split_column": "part"},
            "tasks.split_column",
            ["no column 'part'"],
        ),
        (
            lambda p: write_jsonl(p, _with(GOOD, 4, task_id="train-0")),
            {},
            "tasks.id_column",
            ["duplicate task ids in 'task_id': 'train-0' (rows 1, 5)"],
        ),
        (
            lambda p: write_jsonl(p, _with(GOOD, 1, task_id=None)),
            {},
            "tasks.id_column",
            ["'task_id' is empty in rows 2"],
        ),
        (
            lambda p: write_jsonl(p, _with(GOOD, 2, family="")),
            {},
            "tasks.family_column",
            ["'family' is empty in rows 3"],
        ),
        (
            lambda p: write_jsonl(p, _with(_with(GOOD, 1, split="dev"), 3, split="dev")),
            {},
            "tasks.split_column",
            ["'dev' in rows 2, 4 is not a split", "train, holdout, protected, canary"],
        ),
        (
            lambda p: pd.DataFrame(_with(GOOD, 0, when=pd.Timestamp("2024-01-01"))).to_parquet(
                p.with_suffix(".parquet")
            ),
            {"path": "tasks.parquet"},
            "tasks.path",
            ["row 1, column 'when'", "not JSON-serializable"],
        ),
        (
            lambda p: pd.DataFrame(_with(GOOD, 2, score=float("inf"))).to_parquet(p.with_suffix(".parquet")),
            {"path": "tasks.parquet"},
            "tasks.path",
            ["row 3, column 'score'", "not JSON-serializable"],
        ),
    ],
)
def test_a_bad_tasks_file_names_the_file_key_column_and_rows(tmp_path, write, keys, key, fragments):
    write(tmp_path / "tasks.jsonl")
    project = load_project(write_project(tmp_path, {f"tasks.{k}": v for k, v in keys.items()}))
    with pytest.raises(TaskDataError) as caught:
        load_tasks(project)
    assert isinstance(caught.value, ProjectError)
    assert caught.value.file == project.tasks.path
    assert key in caught.value.keys
    assert str(caught.value).startswith(f"{project.tasks.path}: {key}: ")
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_an_env_map_field_missing_from_the_tasks_names_the_project_file(tmp_path):
    project = load_project(write_project(tmp_path, {"harness.env_map": {"LD_Q": "prompt", "LD_A": "answer"}}))
    with pytest.raises(TaskDataError) as caught:
        load_tasks(project)
    assert caught.value.file == project.file
    assert caught.value.keys == ["harness.env_map.LD_Q"]
    assert "no column 'prompt'" in str(caught.value)


def test_many_duplicates_are_summarised(tmp_path):
    rows = [{"task_id": f"t{i % 5}", "family": "f", "split": "train"} for i in range(20)]
    project = load_project(write_project(tmp_path, rows=rows))
    with pytest.raises(TaskDataError, match=r"'t0' \(rows 1, 6, 11 and 1 more\).* and 2 more"):
        load_tasks(project)


@pytest.mark.parametrize(
    ("content", "fragments"),
    [
        (b'{"task_id": "a", "family": "f", "split": "train"}\n{oops\n', ["line 2: not valid JSON"]),
        (b'{"task_id": "a", "family": "f", "split": "train"}\n\n[1, 2]\n', ["line 3: a JSON array"]),
        (b"5\nnull\n", ["line 1: a JSON number", "line 2: a JSON null"]),
        (b'{"task_id": "a\xff", "family": "f", "split": "train"}\n', ["line 1: not UTF-8 (byte 0xff"]),
        (b'{"task_id": "a", "family": "f", "split": "train", "x": NaN}\n', ["line 1: NaN is not JSON"]),
        (b'{"task_id": "a", "family": "f", "split": "train", "x": Infinity}\n', ["Infinity is not JSON"]),
        (b"", ["the file has no task rows"]),
        (b"\n\n", ["the file has no task rows"]),
        (b"[]\n" * 7, ["line 1", "line 3", "and 4 more bad lines"]),
    ],
)
def test_a_bad_jsonl_line_is_named_by_its_line_number(tmp_path, content, fragments):
    project = load_project(write_project(tmp_path))
    project.tasks.path.write_bytes(content)
    with pytest.raises(TaskDataError) as caught:
        load_tasks(project)
    assert set(caught.value.keys) == {"tasks.path"}
    for fragment in fragments:
        assert fragment in str(caught.value)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_an_integer_column_with_a_missing_value_keeps_its_integers(tmp_path, fmt):
    rows = [{**row, "answer": None if i == 1 else row["answer"]} for i, row in enumerate(task_rows())]
    path = tmp_path / f"tasks.{fmt}"
    tmp_path.mkdir(exist_ok=True)
    if fmt == "jsonl":  # the row without an answer lacks the key altogether
        write_jsonl(path, [{k: v for k, v in row.items() if v is not None} for row in rows])
    elif fmt == "csv":  # written by hand: pandas would write the column as floats
        lines = ["task_id,family,split,answer"]
        lines += [
            f"{r['task_id']},{r['family']},{r['split']},{'' if r['answer'] is None else r['answer']}"
            for r in rows
        ]
        path.write_text("\n".join(lines) + "\n")
    else:  # written by pyarrow as a nullable int64 column, with no pandas dtype metadata
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_tasks(_project(tmp_path, path.name))
    answers = {task["task_id"]: task["answer"] for task in tasks.splits["train"]}
    assert answers == {"train-0": 0, "train-1": None, "train-2": 2}
    assert type(answers["train-2"]) is int


def test_an_id_family_or_split_that_is_not_text_or_a_number_is_refused(tmp_path):
    rows = _with(_with(GOOD, 1, task_id=True), 4, family={"name": "a"})
    project = load_project(write_project(tmp_path, rows=rows))
    with pytest.raises(TaskDataError) as caught:
        load_tasks(project)
    assert caught.value.keys == ["tasks.id_column", "tasks.family_column"]
    assert "'task_id' is not text or a number in rows 2" in str(caught.value)
    assert "'family' is not text or a number in rows 5" in str(caught.value)
