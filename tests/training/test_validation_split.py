"""The validation split: tasks of the train split (the training distribution), never a held-out, protected
or canary case, and never a task the run trains on, over the example projects."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dagster.project.examples import example_tasks
from lightning_dagster.training.selection import reserved_validation, train_tasks, validation_split


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


def _small_task_set(n_train: int):
    """A project's task set with `n_train` train rows (and nothing else), as a user's small file gives."""
    from dataclasses import replace

    tasks = example_tasks("calc")
    return replace(tasks, splits={**tasks.splits, "train": tasks.splits["train"][:n_train]})


@settings(max_examples=60, deadline=None)
@given(
    n_train=st.integers(1, 40),
    asked=st.integers(0, 80),
    steps_x_tasks=st.integers(1, 200),
    seed=st.integers(0, 2**31),
    eval_seed=st.integers(0, 2**31),
)
def test_train_tasks_leave_the_reserved_validation_cases_to_validation(
    n_train, asked, steps_x_tasks, seed, eval_seed
):
    """However small the train split, the run's train tasks never include a reserved validation case, the
    reservation keeps at least half the split for training, and `validation_split` then finds exactly the
    reserved cases first: checkpoint selection has cases whenever the split has two or more tasks."""
    tasks = _small_task_set(n_train)
    reserved = reserved_validation(tasks, asked, eval_seed)
    assert len(reserved) == min(asked, n_train // 2)
    trained = train_tasks(tasks, steps_x_tasks, seed, validation=asked, eval_seed=eval_seed)
    assert len(trained) == steps_x_tasks and not {t["task_id"] for t in trained} & reserved
    drawn = validation_split(tasks, asked, eval_seed, trained)
    assert {t["task_id"] for t in drawn[: len(reserved)]} == reserved
    if asked and n_train >= 2:
        assert drawn
    # the same inputs cut the same tasks (a snapshot's manifest is re-derivable)
    assert trained == train_tasks(tasks, steps_x_tasks, seed, validation=asked, eval_seed=eval_seed)


def test_a_one_task_train_split_reserves_nothing_and_trains_on_it():
    tasks = _small_task_set(1)
    assert reserved_validation(tasks, 64, 0) == frozenset()
    assert [t["task_id"] for t in train_tasks(tasks, 3, 0, validation=64, eval_seed=0)] == [
        tasks.splits["train"][0]["task_id"]
    ] * 3
