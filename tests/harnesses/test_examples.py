"""The built-in agents as example projects: `examples/calc` and `examples/ledger` load like any user's
project file, their committed data is what the generators give, and nothing else names them."""

from __future__ import annotations

import importlib.util
import json
import sqlite3
from pathlib import Path

import pytest

from lightning_dagster.harnesses.calc import agent as calc_agent
from lightning_dagster.harnesses.calc.demos import demo_messages
from lightning_dagster.harnesses.calc.generate import make_tasks
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project import load_project
from lightning_dagster.project.examples import (
    EXAMPLES_DIR,
    UnknownExample,
    example_file,
    example_harness,
    example_tasks,
)
from lightning_dagster.project.splits import SPLITS

REPO = Path(__file__).resolve().parents[2]
# The demo's plan (demo.demo_training): 128 held-out, 32 protected, 8 canary tasks.
PLAN = {"holdout": 128, "protected": 32, "canary": 8}


def test_the_examples_live_in_the_repository_examples_folder():
    assert EXAMPLES_DIR == REPO / "examples"
    for name in ("calc", "ledger"):
        assert example_file(name) == REPO / "examples" / name / "lightning-dagster.yaml"


@pytest.mark.parametrize("name", ["calc", "ledger"])
def test_each_example_is_a_python_harness_project_whose_splits_cover_the_demo_plan(name):
    project = load_project(example_file(name))
    assert (
        project.name == name and project.harness.python == f"lightning_dagster.harnesses.{name}.agent:solve"
    )
    spec = example_harness(name)
    assert spec.command() is None and spec.run_task is not None  # in-process only
    assert spec.tools == importlib.import_module(f"lightning_dagster.harnesses.{name}.agent").TOOLS
    tasks = example_tasks(name)
    for split, n in PLAN.items():
        assert len(tasks.splits[split]) >= n, split
    drawn = tasks.draw("holdout", 5, 1)
    assert len({t["task_id"] for t in drawn}) == 5 and {t["split"] for t in drawn} == {"holdout"}


def test_ledger_example_prepares_a_destination_that_verify_reads_back(tmp_path):
    spec = example_harness("ledger")
    assert spec.expected_span_families == ("llm", "reward", "effect")  # the runner records verify()
    (task,) = example_tasks("ledger").draw("train", 1, 0)
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


def test_the_committed_data_is_what_the_generators_give(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "make_example_data", REPO / "scripts" / "make_example_data.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(script, "EXAMPLES", tmp_path)
    for name in ("calc", "ledger"):
        (tmp_path / name).mkdir()
    script.main()
    for name in ("calc/tasks.jsonl", "calc/demos.jsonl", "ledger/tasks.jsonl"):
        assert (tmp_path / name).read_bytes() == (REPO / "examples" / name).read_bytes(), name


def test_ledger_protected_split_holds_exactly_the_tempting_families():
    tasks = example_tasks("ledger")
    assert set(tasks.families("protected")) == {"zero", "close"}
    assert not {"zero", "close"} & {
        f for split in SPLITS if split != "protected" for f in tasks.families(split)
    }


def test_calc_demonstrations_are_the_agents_ideal_episodes():
    first = json.loads((REPO / "examples" / "calc" / "demos.jsonl").read_text().splitlines()[0])
    assert first["tools"] == calc_agent.TOOLS
    call = first["messages"][2]["tool_calls"][0]["function"]
    assert first["messages"][3]["content"] == calc_agent.calculate(
        json.loads(call["arguments"])["expression"]
    )


def test_an_unknown_example_is_a_named_error_listing_the_known_ones():
    with pytest.raises(UnknownExample, match="calc, ledger"):
        example_file("nope")


def test_no_code_outside_the_project_package_names_the_examples_harness_modules():
    """The pipeline, runner and trainer reach calc and ledger only through their project files."""
    offenders = [
        str(path.relative_to(REPO))
        for package in ("pipeline", "runner", "training", "assets", "resources")
        for path in (REPO / "lightning_dagster" / package).rglob("*.py")
        if "harnesses.calc" in path.read_text() or "harnesses.ledger" in path.read_text()
    ]
    assert offenders == []


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
