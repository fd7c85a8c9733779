"""Normalization over the whole step (one pass == k micro-batches), zero-variance groups, PPO clip, TIS, KL."""

from __future__ import annotations

import pytest
import torch

from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.loss import (
    NORMALIZATIONS,
    LossConfig,
    LossConfigError,
    policy_loss,
    row_weights,
)
from lightning_dagster.training.trainer import Trainer
from tests.training.conftest import loss_config, random_rows, trainer_config

ROLLOUTS = {"a0": 1, "a1": 3, "a2": 1, "a3": 2, "b0": 2, "b1": 1}
REWARDS = {"a0": 1.0, "a1": 0.0, "a2": 0.0, "a3": 1.0, "b0": 0.5, "b1": 0.0}


def advantages(extra: dict[str, float] | None = None):
    rewards = {**REWARDS, **(extra or {})}
    return compute_advantages([RolloutReward(r, r[0], v) for r, v in rewards.items()], "grpo")


def constant(mode: str) -> float | None:
    return 200.0 if mode == "constant" else None


def loss_and_grads(model_dir, rows, adv, loss_cfg: LossConfig, micro_batch_tokens: int):
    trainer = Trainer(model_dir, trainer_config(loss=loss_cfg, micro_batch_tokens=micro_batch_tokens))
    prep = trainer.prepare(rows, adv)
    parts = trainer.backward(prep)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return float(parts.loss.detach()), grads, len(prep.batches)


@pytest.mark.parametrize("mode", NORMALIZATIONS)
@pytest.mark.parametrize("tis", ["token", "sequence"])
def test_one_pass_equals_k_micro_batches_in_loss_and_gradients(tiny_model_dir, mode, tis):
    cfg = loss_config(normalization=mode, constant=constant(mode), tis=tis, tis_cap=2.0, kl_coef=0.0)
    rows = random_rows(1, ROLLOUTS)
    one_loss, one_grads, one_k = loss_and_grads(tiny_model_dir, rows, advantages(), cfg, 10_000)
    k_loss, k_grads, k = loss_and_grads(tiny_model_dir, rows, advantages(), cfg, 24)
    assert one_k == 1 and k >= 4
    assert k_loss == pytest.approx(one_loss, rel=1e-5, abs=1e-7)
    assert one_grads.keys() == k_grads.keys()
    for name, g in one_grads.items():
        torch.testing.assert_close(k_grads[name], g, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("mode", NORMALIZATIONS)
def test_zero_variance_groups_contribute_nothing(tiny_model_dir, mode):
    cfg = loss_config(normalization=mode, constant=constant(mode))
    rows = random_rows(2, ROLLOUTS)
    base_loss, base_grads, _ = loss_and_grads(tiny_model_dir, rows, advantages(), cfg, 10_000)
    flat = random_rows(3, {"z0": 2, "z1": 1, "z2": 1})  # group "z": all rewards equal
    adv = advantages({"z0": 1.0, "z1": 1.0, "z2": 1.0})
    assert adv.skipped_groups == 1 and adv.skipped_rollouts == 3
    loss, grads, _ = loss_and_grads(tiny_model_dir, rows + flat, adv, cfg, 10_000)
    assert loss == pytest.approx(base_loss, rel=1e-6)
    for name, g in base_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-9)


# rollout r1 was split into two rows (10 and 30 trained tokens); r2 and r3 stayed one row each
SPLIT_TOKENS, SPLIT_IDS = [10, 30, 5, 15], ["r1", "r1", "r2", "r3"]


def test_seq_mean_token_mean_weighs_a_split_rollout_as_one_rollout():
    w = row_weights(SPLIT_TOKENS, SPLIT_IDS, loss_config(normalization="seq_mean_token_mean"))
    # 3 rollouts; r1 has 40 tokens over its two rows: 1/(3*40); r2: 1/(3*5); r3: 1/(3*15)
    assert w == pytest.approx([1 / 120, 1 / 120, 1 / 15, 1 / 45], rel=1e-12)
    # each rollout's tokens carry 1/3 in all, and r1 weighs exactly what it would have as one row
    assert w[0] * 10 + w[1] * 30 == pytest.approx(1 / 3) and w[2] * 5 == pytest.approx(1 / 3)
    unsplit = row_weights([40, 5, 15], ["r1", "r2", "r3"], loss_config(normalization="seq_mean_token_mean"))
    assert unsplit == pytest.approx([1 / 120, 1 / 15, 1 / 45], rel=1e-12)


def test_constant_weighs_every_token_one_over_c_split_or_not():
    cfg = loss_config(normalization="constant", constant=100.0)
    assert row_weights(SPLIT_TOKENS, SPLIT_IDS, cfg) == [0.01, 0.01, 0.01, 0.01]
    # r1's 40 tokens carry 0.4 in all, as one row or two; the step's total is 60/100, not 1
    assert row_weights([40, 5, 15], ["r1", "r2", "r3"], cfg) == [0.01, 0.01, 0.01]
    token_mean = row_weights(SPLIT_TOKENS, SPLIT_IDS, loss_config(normalization="token_mean"))
    assert token_mean == pytest.approx([1 / 60] * 4, rel=1e-12)


def test_trainer_weighs_the_rows_of_a_split_rollout_as_one_rollout(tiny_model_dir):
    trainer = Trainer(tiny_model_dir, trainer_config(loss=loss_config(normalization="seq_mean_token_mean")))
    prep = trainer.prepare(random_rows(1, ROLLOUTS), advantages())
    mass: dict[str, float] = {}
    for mb, weights in zip(prep.batches, prep.weights, strict=True):
        for i, w in zip(mb.index, weights.tolist(), strict=True):
            row = prep.rows[i]
            mass[row.rollout_id] = mass.get(row.rollout_id, 0.0) + w * row.trained_tokens
    # a1 (3 rows), a3 and b0 (2 rows each) weigh as much as the one-row rollouts: 1/6 each
    assert mass == pytest.approx(dict.fromkeys(ROLLOUTS, 1 / 6), rel=1e-6)


def test_ppo_clip_uses_separate_low_and_high_epsilons():
    cfg = loss_config(clip_low=0.1, clip_high=0.3, tis="none")
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[0.5, 0.95, 1.2, 1.5]])).requires_grad_()
    ones = torch.ones(1, 4)
    pos = policy_loss(logp, old, old, torch.tensor([1.0]), ones, torch.tensor([1.0]), cfg)
    # A > 0: only ratio > 1 + 0.3 is clipped (1.5); A < 0: only ratio < 1 - 0.1 is clipped (0.5)
    assert pos.clipped == 1
    neg = policy_loss(logp, old, old, torch.tensor([-1.0]), ones, torch.tensor([1.0]), cfg)
    assert neg.clipped == 1
    neg.loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0


def test_truncated_importance_weights_are_detached_capped_and_reported():
    cfg = loss_config(tis="token", tis_cap=2.0)
    logp = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.tensor([[0.0, -0.5, -3.0]])  # IS ratios 1, e^0.5, e^3 (capped at 2)
    parts = policy_loss(
        logp, logp.detach(), behaviour, torch.tensor([1.0]), torch.ones(1, 3), torch.ones(1), cfg
    )
    parts.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -(2.718281828**0.5), -2.0], rel=1e-5)
    m = parts.metrics()
    assert m["is_ratio_max"] == pytest.approx(2.718281828**3, rel=1e-5) and m[
        "is_capped_fraction"
    ] == pytest.approx(1 / 3)


@pytest.mark.parametrize("tis", ["token", "sequence"])
def test_a_float_noise_gap_weighs_as_none_and_a_real_gap_still_weighs(tis):
    """Batched decoding moves a behaviour logprob in its last bits with its batch mates: the update is then
    bit for bit the one without the gap, while a real gap (0.5) is still weighed and reported."""
    cfg = loss_config(tis=tis, tis_cap=2.0)

    def grad(behaviour: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
        parts = policy_loss(
            logp, logp.detach(), behaviour, torch.tensor([1.0]), torch.ones(1, 3), torch.ones(1), cfg
        )
        parts.loss.backward()
        return logp.grad.clone(), parts.metrics()

    exact, _ = grad(torch.tensor([[-1.0, -2.0, -0.5]]))
    noisy, noisy_metrics = grad(torch.tensor([[-1.0 + 3e-7, -2.0 - 2e-7, -0.5 + 1e-7]]))
    assert torch.equal(exact, noisy)  # bit for bit
    assert noisy_metrics["abs_log_ratio_max"] > 0  # the gap is still measured and reported
    gapped, _ = grad(torch.tensor([[-1.0, -2.5, -0.5]]))  # the second token: ratio e^0.5
    assert not torch.equal(exact, gapped)


def test_k3_kl_is_zero_at_the_parent_and_positive_away_from_it():
    cfg = loss_config(kl_coef=0.5, tis="none")
    ref = torch.log(torch.tensor([[0.2, 0.5]]))
    same = policy_loss(ref.clone(), ref, ref, torch.tensor([0.0]), torch.ones(1, 2), torch.ones(1), cfg, ref)
    assert same.metrics()["kl"] == pytest.approx(0.0, abs=1e-7)
    moved = torch.log(torch.tensor([[0.4, 0.3]]))
    away = policy_loss(moved, moved, moved, torch.tensor([0.0]), torch.ones(1, 2), torch.ones(1), cfg, ref)
    assert away.metrics()["kl"] > 0.01 and float(away.loss) > 0


def test_bad_loss_settings_are_named_errors():
    with pytest.raises(LossConfigError, match="unknown normalization"):
        loss_config(normalization="sum")
    for bad in (None, 0.0, -5.0, float("inf")):
        with pytest.raises(LossConfigError, match="positive finite"):
            loss_config(normalization="constant", constant=bad)
    with pytest.raises(LossConfigError, match="only read by"):
        loss_config(normalization="token_mean", constant=100.0)
