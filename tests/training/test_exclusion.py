"""A rollout with an invalid span is left out of its step, named, and its group's advantages computed over the
rest; too many left out refuses the step by name. Hand-built batches, the tiny model for the trainer step."""

from __future__ import annotations

import math

import pytest

from lightning_dagster.runner.service import RolloutBatch
from lightning_dagster.training.advantages import compute_advantages
from lightning_dagster.training.step import batch_transitions, excluded_metrics, rows_and_rewards
from lightning_dagster.training.trainer import Trainer
from lightning_dagster.training.transitions import (
    ExcludedRollout,
    TooManyExcludedRollouts,
    TransitionError,
    merge_rollouts,
)
from lightning_dagster.types import Rollout, Span, SpanKind
from tests.training.conftest import step_settings, trainer_config


def call(
    rollout_id: str, seed: int, *, logprob: float | None = None, prompt: list[int] | None = None
) -> Span:
    """One LLM call of a rollout (ids below the tiny model's vocabulary of 64)."""
    response = [10 + (seed + i) % 50 for i in range(4)]
    return Span(
        span_id=f"sp-{rollout_id}",
        rollout_id=rollout_id,
        attempt_id=f"at-{rollout_id}",
        kind=SpanKind.llm,
        prompt_token_ids=[1, 2, 3 + seed % 40] if prompt is None else prompt,
        response_token_ids=response,
        response_logprobs=[-0.5 - 0.1 * i if logprob is None else logprob for i in range(4)],
        finish_reason="stop",
        attributes={"temperature": 1.0},
    )


def batch(groups: dict[str, list[float]], bad: dict[str, dict] | None = None) -> RolloutBatch:
    """Rollouts `g{k}-r{i}` of each group with the given rewards; `bad` maps a rollout id to the invalid
    field its span carries."""
    rollouts, rewards, spans = [], {}, {}
    for group, values in groups.items():
        for i, reward in enumerate(values):
            rid = f"{group}-r{i}"
            rollouts.append(Rollout(rollout_id=rid, group_id=group))
            rewards[rid] = reward
            spans[rid] = [call(rid, len(rollouts), **(bad or {}).get(rid, {}))]
    return RolloutBatch(rollouts=rollouts, rewards=rewards, spans=spans, seconds=0.0)


GROUPS = {"g0": [1.0, 0.0, 1.0, 0.0], "g1": [1.0, 1.0, 0.0, 0.0], "g2": [0.0, 1.0, 0.0, 1.0]}


def test_one_nan_logprob_rollout_is_left_out_and_named(tiny_model_dir):
    """Before, its `TransitionError` failed the whole step for one rollout among twelve."""
    b = batch(GROUPS, {"g1-r2": {"logprob": math.nan}})
    rows, advantages, merge, excluded = batch_transitions(b, step_settings())
    assert excluded == [ExcludedRollout("g1-r2", "sp-g1-r2", excluded[0].reason)]
    assert "logprobs must be finite" in excluded[0].reason
    assert merge["merge_excluded_rollouts"] == 1 and merge["merge_attempts"] == 11
    assert "g1-r2" not in {r.rollout_id for r in rows} and len(rows) == 11
    assert "g1-r2" not in advantages.values and len(advantages.values) == 11

    trainer = Trainer(tiny_model_dir, trainer_config())
    metrics = trainer.step(rows, advantages, extra={**merge, **excluded_metrics(excluded)})
    assert metrics["trained_rows"] == 11 and math.isfinite(metrics["loss"])
    assert metrics["merge_excluded_rollouts"] == 1
    assert metrics["excluded"] == [
        {"rollout_id": "g1-r2", "span_id": "sp-g1-r2", "reason": excluded[0].reason}
    ]


@pytest.mark.parametrize(
    "invalid",
    [
        {"logprob": math.inf},
        {"logprob": 0.5},
        {"prompt": []},
        {"prompt": [1, -2, 3]},
    ],
)
def test_every_kind_of_invalid_span_excludes_its_rollout(invalid):
    _, _, merge = rows_and_rewards(batch(GROUPS, {"g0-r0": invalid}), step_settings())
    assert merge["merge_excluded_rollouts"] == 1


def test_a_non_finite_temperature_excludes_its_rollout():
    b = batch(GROUPS)
    b.spans["g2-r3"] = [b.spans["g2-r3"][0].model_copy(update={"attributes": {"temperature": math.nan}})]
    kept, stats = merge_rollouts(((r, b.spans[r]) for r in b.spans), max_excluded_share=0.1)
    assert "g2-r3" not in kept and [e.rollout_id for e in stats.excluded] == ["g2-r3"]
    assert "temperature" in stats.excluded[0].reason


def test_the_kept_members_advantages_ignore_the_excluded_one():
    """The group's mean and std are over its kept members: as if the excluded rollout had never been
    sampled."""
    with_bad = batch({"g0": [1.0, 0.0, 1.0, 0.0, 1.0]}, {"g0-r4": {"logprob": math.nan}})
    without = batch({"g0": [1.0, 0.0, 1.0, 0.0]})
    for mode in ("grpo", "dr_grpo", "rloo"):
        settings = step_settings(advantage=mode, max_excluded_share=0.25)
        _, got, _, excluded = batch_transitions(with_bad, settings)
        _, expected, _, _ = batch_transitions(without, settings)
        assert [e.rollout_id for e in excluded] == ["g0-r4"]
        assert got.values == expected.values and got.group_stats == expected.group_stats
        assert got.values["g0-r0"] == pytest.approx(
            1.0 if mode == "grpo" else 0.5 if mode == "dr_grpo" else 2 / 3, rel=1e-5
        )


def test_a_group_left_with_one_member_is_skipped_like_any_singleton():
    b = batch({"g0": [1.0, 0.0], "g1": [1.0, 0.0, 1.0, 0.0] * 3}, {"g0-r1": {"logprob": math.nan}})
    _, advantages, _, excluded = batch_transitions(b, step_settings())
    assert len(excluded) == 1
    assert "g0-r0" not in advantages.values  # one member: no variance, no advantage (as before)
    assert advantages.group_stats["g0"] == (1, 1.0, 0.0) and advantages.skipped_rollouts == 1


def test_too_many_invalid_rollouts_refuse_the_step_by_name():
    bad = {rid: {"logprob": math.nan} for rid in ("g0-r1", "g1-r0", "g1-r3", "g2-r2")}
    with pytest.raises(TooManyExcludedRollouts, match="4 of 12 rollouts") as caught:
        batch_transitions(batch(GROUPS, bad), step_settings())
    message = str(caught.value)
    assert "more than the 10% allowed" in message
    assert "rollout g0-r1 span sp-g0-r1: logprobs must be finite" in message and "(and 1 more)" in message
    assert [e.rollout_id for e in caught.value.excluded] == ["g0-r1", "g1-r0", "g1-r3", "g2-r2"]
    assert caught.value.considered == 12
    # the threshold is the user's: a third allowed, the same batch trains on the other eight
    rows, _, _, excluded = batch_transitions(batch(GROUPS, bad), step_settings(max_excluded_share=1 / 3))
    assert len(excluded) == 4 and len(rows) == 8


def test_nothing_left_is_refused_whatever_the_threshold():
    b = batch({"g0": [1.0, 0.0]}, {"g0-r0": {"logprob": math.nan}, "g0-r1": {"prompt": []}})
    with pytest.raises(TooManyExcludedRollouts, match="none is left to train on"):
        rows_and_rewards(b, step_settings(max_excluded_share=1.0))


def test_strict_merging_raises_the_span_error_itself():
    b = batch(GROUPS, {"g1-r2": {"logprob": math.nan}})
    with pytest.raises(TransitionError, match="sp-g1-r2") as caught:
        merge_rollouts(((r, b.spans[r]) for r in b.spans), max_excluded_share=0.1, strict=True)
    assert caught.value.rollout_id == "g1-r2" and caught.value.span_id == "sp-g1-r2"


@pytest.mark.parametrize("share", [-0.1, 1.5, math.nan, True])
def test_an_impossible_threshold_is_refused(share):
    with pytest.raises(ValueError, match="max_excluded_share"):
        merge_rollouts([], max_excluded_share=share)


def test_advantages_of_the_same_rewards_without_exclusion_match_compute_advantages():
    """The wiring adds nothing of its own: with no invalid span, the step's advantages are those of its
    rewards."""
    _, rewards, _ = rows_and_rewards(batch(GROUPS), step_settings())
    _, advantages, _, excluded = batch_transitions(batch(GROUPS), step_settings())
    assert excluded == [] and advantages == compute_advantages(rewards, "grpo")
