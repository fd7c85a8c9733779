"""Checkpoint selection on the validation split: never a checkpoint that lost a parent-solved case when
another kept them all, the recorded fallback, early stopping, and the keeper that holds the chosen weights."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dagster.runner.service import RolloutBatch
from lightning_dagster.training.loop import CheckpointKeeper, selection_summary
from lightning_dagster.training.selection import (
    CheckpointEval,
    ValidationConfigError,
    ValidationSettings,
    judge,
    regressions,
    select,
    solved_cases,
    stop_reason,
)
from lightning_dagster.types import Rollout

PARENT = {"a", "b", "c"}
CASES = 6


def ev(step: int, solved: set[str]) -> CheckpointEval:
    return judge(step, solved, PARENT, CASES)


def test_judge_lists_the_parent_solved_cases_a_checkpoint_lost():
    e = ev(4, {"a", "c", "d", "e"})
    assert e.lost == ("b",) and e.success == pytest.approx(4 / 6)
    assert e.to_dict()["lost_parent_cases"] == 1


def test_solved_cases_use_the_threshold_and_count_a_missing_reward_as_unsolved():
    assert solved_cases({"a": 1.0, "b": 0.5, "c": 0.49, "d": None}, 0.5) == {"a", "b"}


def test_selection_skips_a_higher_scoring_checkpoint_that_lost_a_parent_solved_case():
    evals = [ev(2, {"a", "b", "c"}), ev(4, {"a", "b", "d", "e", "f"}), ev(6, {"a", "b", "c", "d"})]
    chosen = select(evals)
    # step 4 solves the most but lost "c"; step 6 keeps every parent case and beats step 2
    assert chosen.step == 6 and chosen.kept_parent_cases


def test_selection_ties_go_to_the_later_checkpoint():
    evals = [ev(2, {"a", "b", "c", "d"}), ev(4, {"a", "b", "c", "e"}), ev(6, {"a", "b", "c"})]
    assert select(evals).step == 4


def test_selection_falls_back_to_the_checkpoint_losing_fewest_and_says_so():
    evals = [ev(2, {"a"}), ev(4, {"a", "b", "d", "e"}), ev(6, {"b", "c", "d", "e", "f"})]
    chosen = select(evals)
    assert chosen.step == 6 and not chosen.kept_parent_cases and "fallback" in chosen.reason
    # equal losses: the higher success, then the earlier checkpoint
    assert select([ev(2, {"a", "b"}), ev(4, {"a", "c", "d"})]).step == 4
    assert select([ev(2, {"a", "b", "d"}), ev(4, {"a", "c", "d"})]).step == 2


def test_selection_of_nothing_is_refused():
    with pytest.raises(ValueError, match="no checkpoint"):
        select([])


cases = st.sets(st.sampled_from("abcdef"))


@settings(max_examples=300, deadline=None)
@given(st.lists(cases, min_size=1, max_size=8))
def test_selection_never_picks_a_checkpoint_that_lost_a_parent_solved_case_when_another_did_not(solved):
    evals = [ev(2 * (i + 1), s) for i, s in enumerate(solved)]
    chosen = select(evals)
    picked = next(e for e in evals if e.step == chosen.step)
    if any(not e.lost for e in evals):
        assert not picked.lost and chosen.kept_parent_cases
        assert picked.success == max(e.success for e in evals if not e.lost)
    else:
        assert not chosen.kept_parent_cases and len(picked.lost) == min(len(e.lost) for e in evals)
    # the choice over a prefix only ever moves to the newest checkpoint: the keeper holds one copy
    for k in range(1, len(evals)):
        before, after = select(evals[:k]).step, select(evals[: k + 1]).step
        assert after in (before, evals[k].step)


def test_an_evaluation_regresses_when_it_loses_a_parent_case_or_falls_below_the_best_so_far():
    evals = [ev(2, {"a", "b", "c", "d"}), ev(4, {"a", "b", "c"}), ev(6, {"a", "b", "c", "d"}), ev(8, {"a"})]
    assert regressions(evals, parent_success=3 / 6) == [False, True, False, True]


def test_training_stops_after_patience_regressions_in_a_row_and_not_on_a_plateau():
    up = ev(2, {"a", "b", "c", "d"})
    lost = ev(4, {"a", "b", "d", "e"})
    lower = ev(6, {"a", "b", "c"})
    assert stop_reason([up, lost], 0.5, patience=2) is None
    reason = stop_reason([up, lost, lower], 0.5, patience=2)
    assert reason is not None and "steps 4, 6" in reason
    plateau = [up, ev(4, {"a", "b", "c", "e"}), ev(6, {"a", "b", "c", "f"})]
    assert stop_reason(plateau, 0.5, patience=1) is None
    assert stop_reason([up, lost, lower], 0.5, patience=0) is None


def validation(**changes) -> ValidationSettings:
    return ValidationSettings(**{"tasks": 64, "every": 2, "patience": 2, "success_threshold": 0.5, **changes})


def test_bad_validation_settings_are_named_errors():
    for bad in ({"tasks": -1}, {"every": 0}, {"patience": -1}, {"success_threshold": 0.0}):
        with pytest.raises(ValidationConfigError):
            validation(**bad)


# ---------------------------------------------------------------------------------------------------------
# the keeper, with a served "model" that is a table: which validation cases each weight version solves


class TableService:
    """Serves a version number; `run` solves the cases the table lists for the version being served."""

    def __init__(self, table: dict[int, set[str]]) -> None:
        self.table, self.version, self.runs = table, 0, []

    def load_weights(self, state_dict: dict, resource_id: str | None = None) -> None:
        self.version = int(state_dict["v"])

    def run(self, tasks, *, group, kind, sampling, seed, tag, snapshot_key=None) -> RolloutBatch:
        self.runs.append((kind, sampling.temperature, snapshot_key, tag))
        rollouts = [Rollout(task_id=t["task_id"], task=t) for t in tasks]
        solved = self.table[self.version]
        rewards = {r.rollout_id: float(r.task_id in solved) for r in rollouts}
        return RolloutBatch(rollouts=rollouts, rewards=rewards, spans={}, seconds=0.0)


class CountingTrainer:
    """Weights are one number: the step that made them."""

    def __init__(self) -> None:
        self.model = self
        self.v = torch.tensor(0.0)

    def state_dict(self) -> dict:
        return {"v": self.v.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.v = state["v"].clone()

    snapshot, restore = state_dict, load_state_dict  # the keeper keeps and restores through these


def run_keeper(table: dict[int, set[str]], steps: int, validation: ValidationSettings):
    service, trainer = TableService(table), CountingTrainer()
    tasks = [{"task_id": t} for t in "abcdef"]
    keeper = CheckpointKeeper(service, tasks, validation, seed=7, tag="k")  # type: ignore[arg-type]
    for step in range(1, steps + 1):
        trainer.v = torch.tensor(float(step))
        service.load_weights(trainer.state_dict())
        keeper.after_step(step, steps, trainer)  # type: ignore[arg-type]
        if keeper.early_stop:
            break
    chosen = keeper.restore(trainer)  # type: ignore[arg-type]
    return keeper, chosen, trainer, service


def test_a_regression_at_the_last_step_is_not_an_early_stop():
    table = {0: {"a", "b", "c"}, 2: {"a"}, 4: {"a"}}
    keeper, chosen, *_ = run_keeper(table, 4, validation(every=2, patience=2))
    assert [e.step for e in keeper.evals] == [2, 4] and keeper.early_stop is None
    assert selection_summary(0.1, 4, keeper, chosen)["early_stop"] is None
    keeper, *_ = run_keeper(table, 6, validation(every=2, patience=2))
    assert [e.step for e in keeper.evals] == [2, 4] and "steps 2, 4" in keeper.early_stop


def test_keeper_restores_the_chosen_checkpoint_and_stops_when_validation_regresses():
    table = {0: {"a", "b", "c"}, 2: {"a", "b", "c", "d"}, 4: {"a", "b", "e", "f"}, 6: {"a"}, 8: {"a", "b"}}
    keeper, chosen, trainer, service = run_keeper(table, 10, validation(every=2, patience=2))
    assert [e.step for e in keeper.evals] == [2, 4, 6]  # 4 and 6 regressed: steps 8 and 10 never ran
    assert keeper.early_stop is not None and chosen.step == 2 and chosen.kept_parent_cases
    assert float(trainer.v) == 2.0  # the chosen weights, not the last ones
    # greedy, outside any snapshot, one run for the parent and one per evaluated checkpoint
    assert {(kind.value, temp, key) for kind, temp, key, _ in service.runs} == {("validation", 0.0, None)}
    assert [tag for *_, tag in service.runs] == ["k-val-parent", "k-val-s2", "k-val-s4", "k-val-s6"]
    summary = selection_summary(0.1, 6, keeper, chosen)
    assert summary["chosen_step"] == 2 and summary["validation_tasks"] == 6 and summary["kl_coef"] == 0.1
    assert [c["lost_parent_cases"] for c in summary["checkpoints"]] == [0, 1, 2]
    assert summary["parent_validation_success"] == pytest.approx(0.5) and summary["early_stop"]


def test_keeper_evaluates_the_last_step_and_falls_back_when_every_checkpoint_lost_a_case():
    table = {0: {"a", "b", "c"}, 2: {"a", "b"}, 3: {"a", "b", "c", "d"}, 1: set()}
    keeper, chosen, trainer, _ = run_keeper(table, 3, validation(every=2, patience=0))
    assert [e.step for e in keeper.evals] == [2, 3] and chosen.step == 3 and float(trainer.v) == 3.0
    table = {0: {"a", "b", "c"}, 1: set(), 2: {"a", "b"}, 3: {"a"}}
    keeper, chosen, trainer, _ = run_keeper(table, 3, validation(every=1, patience=0))
    assert chosen.step == 2 and not chosen.kept_parent_cases and float(trainer.v) == 2.0
