"""The transitions file between the pipeline's transitions and training stages: round trip (header too), and
damaged files refused by name."""

from __future__ import annotations

import gzip
import json
import logging

import pytest

from lightning_dagster.pipeline.transitions_file import (
    TokenizerMismatch,
    TransitionsFileError,
    load_transitions,
    write_transitions,
)
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.transitions import ExcludedRollout
from tests.training.conftest import random_rows


def read_transitions(uri: str, *, tokenizer: str | None = None):
    loaded = load_transitions(uri, tokenizer=tokenizer)
    return loaded.rows, loaded.advantages


def _written(tmp_path):
    rows = random_rows(3, {"a": 2, "b": 1})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    return write_transitions(tmp_path / "t.jsonl.gz", rows, adv, tokenizer=TOKENIZER), rows, adv


TOKENIZER = "sha256:" + "ab" * 32


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


def test_the_header_round_trips_the_tokenizer_and_the_excluded_rollouts(tmp_path):
    rows = random_rows(4, {"a": 1, "b": 2})
    adv = compute_advantages([RolloutReward("a", "g", 1.0), RolloutReward("b", "g", 0.0)], "grpo")
    excluded = [ExcludedRollout("c", "sp-c", "logprobs must be finite and <= 0, got [nan]")]
    path = write_transitions(tmp_path / "t.jsonl.gz", rows, adv, tokenizer=TOKENIZER, excluded=excluded)
    head = json.loads(_lines(path)[0])
    assert head["version"] == 1 and head["rows"] == 3 and head["tokenizer"] == TOKENIZER
    got = load_transitions(path.as_uri(), tokenizer=TOKENIZER)
    assert (got.rows, got.advantages, got.tokenizer) == (rows, adv, TOKENIZER)
    assert got.excluded == [{"rollout_id": "c", "span_id": "sp-c", "reason": excluded[0].reason}]


def test_another_tokenizer_is_refused_naming_both_fingerprints(tmp_path):
    path, _, _ = _written(tmp_path)
    other = "sha256:" + "cd" * 32
    with pytest.raises(
        TokenizerMismatch, match=f"built with tokenizer {TOKENIZER}.*tokenizer is {other}"
    ) as e:
        load_transitions(path.as_uri(), tokenizer=other)
    assert (e.value.recorded, e.value.expected) == (TOKENIZER, other)
    with pytest.raises(TokenizerMismatch):
        read_transitions(path.as_uri(), tokenizer=other)
    assert read_transitions(path.as_uri(), tokenizer=TOKENIZER)[0]  # its own passes


def test_a_file_from_before_fingerprints_is_read_with_a_warning(tmp_path, caplog):
    """Files written before the header had a tokenizer keep training (the trainer still refuses ids beyond
    the vocabulary); the warning says the check could not be made and how to rebuild."""
    path, rows, adv = _written(tmp_path)
    lines = _lines(path)
    head = json.loads(lines[0])
    del head["tokenizer"], head["excluded"]
    _rewrite(path, [json.dumps(head), *lines[1:]])
    with caplog.at_level(logging.WARNING):
        got = load_transitions(path.as_uri(), tokenizer=TOKENIZER)
    assert (got.rows, got.advantages, got.tokenizer, got.excluded) == (rows, adv, None, [])
    assert "no tokenizer fingerprint" in caplog.text and "re-materialize training_transitions" in caplog.text


def test_a_fingerprint_that_is_not_a_string_is_refused(tmp_path):
    path, _, _ = _written(tmp_path)
    lines = _lines(path)
    _rewrite(path, [json.dumps({**json.loads(lines[0]), "tokenizer": 7}), *lines[1:]])
    with pytest.raises(TransitionsFileError, match="tokenizer fingerprint 7"):
        read_transitions(path.as_uri())
