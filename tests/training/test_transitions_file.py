"""The transitions file between the pipeline's transitions and training stages: round trip, and damaged
files refused by name."""

from __future__ import annotations

import gzip
import json

import pytest

from lightning_dagster.pipeline.transitions_file import (
    TransitionsFileError,
    read_transitions,
    write_transitions,
)
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from tests.training.conftest import random_rows


def _written(tmp_path):
    rows = random_rows(3, {"a": 2, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    return write_transitions(tmp_path / "t.jsonl.gz", rows, adv), rows, adv


def test_round_trip(tmp_path):
    path, rows, adv = _written(tmp_path)
    got_rows, got_adv = read_transitions(path.as_uri())
    assert got_rows == rows and got_adv == adv


def _lines(path):
    with gzip.open(path, "rt") as f:
        return f.read().splitlines()


def _rewrite(path, lines):
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")


def test_a_file_missing_rows_is_refused(tmp_path):
    """Before, a file cut at a line boundary trained on whatever rows were left, without a word."""
    path, _, _ = _written(tmp_path)
    _rewrite(path, _lines(path)[:-1])
    with pytest.raises(TransitionsFileError, match="2 rows, its header announces 3"):
        read_transitions(path.as_uri())


def test_truncated_bytes_another_version_or_foreign_rows_are_refused(tmp_path):
    path, _, _ = _written(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TransitionsFileError):
        read_transitions(path.as_uri())
    path, _, _ = _written(tmp_path)
    lines = _lines(path)
    head = json.loads(lines[0])
    _rewrite(path, [json.dumps({**head, "version": 2}), *lines[1:]])
    with pytest.raises(TransitionsFileError, match="version 2"):
        read_transitions(path.as_uri())
    _rewrite(path, [lines[0], json.dumps({**json.loads(lines[1]), "tokenizer": "x"}), *lines[2:]])
    with pytest.raises(TransitionsFileError, match="tokenizer"):
        read_transitions(path.as_uri())
