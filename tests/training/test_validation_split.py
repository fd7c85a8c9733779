"""The validation split: tasks of the train split (the training distribution), never a held-out, protected
or canary case, and never a task the run trains on, over the example projects."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dagster.project.examples import example_tasks
from lightning_dagster.training.loop import validation_split


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["calc", "ledger"]),
    n=st.integers(0, 400),
    pool=st.integers(0, 1500),
    seed=st.integers(0, 2**31),
    pool_seed=st.integers(0, 2**31),
)
def test_validation_split_is_disjoint_from_closed_splits_and_the_train_pool(name, n, pool, seed, pool_seed):
    tasks = example_tasks(name)
    trained = tasks.draw("train", pool, pool_seed)
    drawn = validation_split(tasks, n, seed, trained)
    ids = [t["task_id"] for t in drawn]
    assert len(ids) == len(set(ids)) and all(t["split"] == "train" for t in drawn)
    closed = {t["task_id"] for split in ("holdout", "protected", "canary") for t in tasks.splits[split]}
    assert not set(ids) & closed and not set(ids) & {t["task_id"] for t in trained}
    left = len(tasks.splits["train"]) - len({t["task_id"] for t in trained})
    assert len(ids) == min(n, left)
    assert drawn == validation_split(tasks, n, seed, trained)  # a re-run draws the same cases


def test_validation_split_depends_on_its_seed():
    tasks = example_tasks("calc")
    a, b = validation_split(tasks, 32, 1, []), validation_split(tasks, 32, 2, [])
    assert a != b and len(a) == len(b) == 32


@pytest.mark.parametrize("name", ["calc", "ledger"])
def test_a_run_training_on_the_whole_train_split_leaves_no_validation_task(name):
    tasks = example_tasks(name)
    everything = tasks.draw("train", 2 * len(tasks.splits["train"]), 0)
    assert validation_split(tasks, 64, 0, everything) == []
