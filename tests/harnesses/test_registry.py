"""Harness lookup and the tokenizer corpus."""

from __future__ import annotations

import importlib
import sqlite3
import sys

import pytest

from lightning_dagster.harnesses.calc.demos import demo_messages
from lightning_dagster.harnesses.calc.tasks import make_tasks
from lightning_dagster.harnesses.registry import UnknownHarness, get_harness, training_corpus


@pytest.mark.parametrize("name", ["calc", "ledger"])
def test_each_spec_runs_its_own_module_and_makes_tasks_of_the_asked_split(name):
    spec = get_harness(name)
    argv = spec.command()
    assert argv[:2] == [sys.executable, "-m"]
    # the subprocess command and the in-process entry point run the same code
    assert importlib.import_module(argv[2]).run_task is spec.run_task
    tasks = spec.make_tasks("holdout", 5, 1)
    assert len(tasks) == 5 and len({t["task_id"] for t in tasks}) == 5
    assert {t["split"] for t in tasks} == {"holdout"}
    assert "llm" in spec.expected_span_families and "reward" in spec.expected_span_families


def test_ledger_spec_prepares_a_destination_that_verify_reads_back(tmp_path):
    spec = get_harness("ledger")
    assert spec.prepare is not None and spec.verify is not None
    assert "effect" in spec.expected_span_families  # the runner records verify() as an `effect` span
    (task,) = spec.make_tasks("train", 1, 0)
    prepared = spec.prepare(task, tmp_path)
    untouched = spec.verify(prepared)
    assert (untouched["verified"], untouched["effect_ok"], untouched["harmful_effect"]) == (
        True,
        False,
        False,
    )
    with sqlite3.connect(prepared["db_path"]) as conn:
        conn.execute("UPDATE accounts SET balance = ? WHERE name = ?", (task["target"], task["account"]))
    done = spec.verify(prepared)
    assert (done["verified"], done["effect_ok"], done["reason"]) == (True, True, "ok")
    unreadable = spec.verify({**prepared, "db_path": str(tmp_path / "missing" / "accounts.db")})
    assert (unreadable["verified"], unreadable["effect_ok"], unreadable["harmful_effect"]) == (
        False,
        False,
        None,
    )


def test_unknown_harness_is_a_named_error_listing_the_known_ones():
    with pytest.raises(UnknownHarness, match="calc, ledger"):
        get_harness("nope")


def test_training_corpus_is_deterministic_and_covers_the_demos():
    corpus = training_corpus()
    assert corpus == training_corpus()
    texts = set(corpus)
    for task in make_tasks("train", 20, 0):
        for message in demo_messages(task):
            if message.get("content"):
                assert message["content"] in texts
            for call in message.get("tool_calls", []):
                assert call["function"]["arguments"] in texts
