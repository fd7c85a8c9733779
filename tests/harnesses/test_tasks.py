"""Task sets: deterministic per seed, content-addressed, and disjoint across splits."""

from __future__ import annotations

import pytest

from lightning_dagster.harnesses.calc.generate import make_tasks as calc_tasks
from lightning_dagster.harnesses.ledger.generate import PROTECTED_FAMILIES
from lightning_dagster.harnesses.ledger.generate import make_tasks as ledger_tasks
from lightning_dagster.project.splits import SPLITS, UnknownSplit, content_hash

MAKERS = {"calc": calc_tasks, "ledger": ledger_tasks}


@pytest.mark.parametrize("name", MAKERS)
def test_make_tasks_is_deterministic_per_seed(name):
    make = MAKERS[name]
    assert make("train", 50, 3) == make("train", 50, 3)
    assert make("train", 50, 3) != make("train", 50, 4)


@pytest.mark.parametrize("name", MAKERS)
def test_splits_are_disjoint_across_seeds(name):
    make = MAKERS[name]
    ids = {split: {t["task_id"] for seed in (0, 1) for t in make(split, 150, seed)} for split in SPLITS}
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not ids[a] & ids[b], f"{a} and {b} share tasks"
    # distinct tasks within a split, and the requested count
    assert all(
        len(make(split, 150, 0)) == len({t["task_id"] for t in make(split, 150, 0)}) for split in SPLITS
    )


@pytest.mark.parametrize("name", MAKERS)
def test_task_id_is_the_content_hash(name):
    for task in MAKERS[name]("holdout", 20, 0):
        content = {k: v for k, v in task.items() if k not in ("task_id", "split")}
        assert task["task_id"] == content_hash(content)
        assert task["family"] and task["split"] == "holdout"


def test_calc_covers_every_family_and_answers_are_correct():
    tasks = calc_tasks("train", 300, 0)
    assert {t["family"] for t in tasks} == {"add", "sub", "mul", "div", "two_step"}
    from lightning_dagster.harnesses.calc.agent import calculate

    assert all(calculate(t["expression"]) == str(t["answer"]) for t in tasks)


def test_ledger_protected_split_is_exactly_the_delete_tempting_families():
    assert {t["family"] for t in ledger_tasks("protected", 40, 0)} <= set(PROTECTED_FAMILIES)
    for split in ("train", "holdout", "canary"):
        assert not {t["family"] for t in ledger_tasks(split, 60, 0)} & set(PROTECTED_FAMILIES)


def test_unknown_split_is_refused():
    with pytest.raises(UnknownSplit, match="serve"):
        calc_tasks("serve", 3, 0)
