"""Rollout-level advantages: modes, zero-variance groups, duplicated rows, serve rollouts."""

from __future__ import annotations

import math

import pytest

from lightning_dagster.training.advantages import AdvantageError, RolloutReward, compute_advantages


def group(gid: str, rewards: list[float]) -> list[RolloutReward]:
    return [RolloutReward(f"{gid}-{i}", gid, r) for i, r in enumerate(rewards)]


def test_grpo_is_mean_centred_and_divided_by_group_std():
    adv = compute_advantages(group("g", [1, 0, 0, 1]), "grpo")
    assert [round(adv.values[f"g-{i}"], 5) for i in range(4)] == [1.0, -1.0, -1.0, 1.0]


def test_dr_grpo_does_not_divide_and_rloo_leaves_one_out():
    rewards = [1.0, 0.0, 0.0, 0.0]
    dr = compute_advantages(group("g", rewards), "dr_grpo").values
    assert dr["g-0"] == pytest.approx(0.75) and dr["g-1"] == pytest.approx(-0.25)
    rloo = compute_advantages(group("g", rewards), "rloo").values
    assert rloo["g-0"] == pytest.approx(1.0) and rloo["g-1"] == pytest.approx(-1 / 3)


def test_zero_variance_groups_are_skipped_and_counted():
    adv = compute_advantages(group("a", [1, 1, 1]) + group("b", [0, 0]) + group("c", [1, 0]), "grpo")
    assert set(adv.values) == {"c-0", "c-1"}
    assert adv.skipped_groups == 2 and adv.skipped_rollouts == 5 and adv.groups == 3


def test_duplicated_rollout_rows_do_not_change_any_group_statistic():
    base = group("g", [1, 0, 0, 0.5]) + group("h", [0, 1])
    once = compute_advantages(base, "grpo")
    rows_view = base + [base[0]] * 3 + [base[4]]  # one rollout that became four rows, another two
    twice = compute_advantages(rows_view, "grpo")
    assert twice.values == once.values and twice.group_stats == once.group_stats
    assert twice.reward_mean == once.reward_mean


def test_conflicting_rewards_for_one_rollout_are_an_error():
    with pytest.raises(AdvantageError):
        compute_advantages([RolloutReward("r", "g", 1.0), RolloutReward("r", "g", 0.0)])
    with pytest.raises(AdvantageError):
        compute_advantages([], "ppo")  # type: ignore[arg-type]


def test_serve_rollouts_without_group_are_batch_whitened():
    serve = [RolloutReward(f"s{i}", None, r) for i, r in enumerate([0.0, 1.0, 2.0])]
    adv = compute_advantages(serve + group("g", [1, 0]), "dr_grpo")
    std = math.sqrt(2 / 3)
    assert adv.values["s0"] == pytest.approx(-1 / std, rel=1e-5) and adv.values["s1"] == pytest.approx(0.0)
    assert adv.values["g-0"] == pytest.approx(0.5)  # the grouped ones still use the group mode
    whiten = compute_advantages(group("g", [1, 0, 0, 0]), "whiten").values
    assert sum(whiten.values()) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "whiten"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_a_reward_that_is_not_a_finite_number_is_a_named_error(mode, bad):
    """One NaN (or infinite, or missing) reward made every advantage of its group NaN, and the trainer step
    then wrote NaN into every weight."""
    rewards = [RolloutReward("a", "g", 1.0), RolloutReward("b", "g", bad), RolloutReward("c", "g", 0.0)]
    with pytest.raises(AdvantageError, match="rollout b"):
        compute_advantages(rewards, mode)
