"""Harness lookup and the tokenizer corpus."""

from __future__ import annotations

import sys

import pytest

from lightning_dagster.harnesses.calc.demos import demo_messages
from lightning_dagster.harnesses.calc.tasks import make_tasks
from lightning_dagster.harnesses.registry import UnknownHarness, get_harness, training_corpus


def test_get_harness_returns_runnable_specs():
    calc = get_harness("calc")
    assert calc.command() == [sys.executable, "-m", "lightning_dagster.harnesses.calc.agent"]
    assert calc.make_tasks("train", 2, 0) == make_tasks("train", 2, 0)
    assert set(calc.expected_span_families) == {"llm", "reward"}
    ledger = get_harness("ledger")
    assert ledger.verify is not None and ledger.prepare is not None
    assert "effect" in ledger.expected_span_families
    with pytest.raises(UnknownHarness, match="calc"):
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
