"""The k3 KL to the exact parent: zero with zero gradient at the parent, a gradient that pulls each sampled
token's logprob back to the parent's, and `kl_coef=0` as exactly the update without the term."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dagster.settings import TrainingSettings
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.loss import LossConfigError, policy_loss
from lightning_dagster.training.trainer import Trainer, response_logprobs
from tests.training.conftest import loss_config, random_rows, trainer_config

ROLLOUTS = {"a": 2, "b": 1, "c": 1, "d": 1}


def batch():
    rows = random_rows(11, ROLLOUTS)
    adv = compute_advantages([RolloutReward(r, "g", float(r in "ab")) for r in ROLLOUTS], "grpo")
    return rows, adv


def test_kl_is_on_by_default_and_a_bad_weight_is_a_named_error():
    assert loss_config().kl_coef == TrainingSettings().kl_coef > 0
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(LossConfigError, match="kl_coef"):
            loss_config(kl_coef=bad)


def test_kl_gradient_moves_each_sampled_logprob_toward_the_parent():
    cfg = loss_config(kl_coef=0.5, tis="none")
    ref = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    logp = torch.log(torch.tensor([[0.4, 0.25, 0.3]])).requires_grad_()
    weights = torch.tensor([1.0])
    parts = policy_loss(
        logp, logp.detach(), logp.detach(), torch.zeros(1), torch.ones(1, 3), weights, cfg, ref
    )
    parts.loss.backward()
    # d/dlogp of k3 = 1 - exp(ref - logp): the advantage is 0, so this is the whole gradient
    expected = 0.5 * (1 - torch.exp(ref - logp.detach()))
    assert torch.allclose(logp.grad, expected)
    stepped = logp.detach() - 0.1 * logp.grad
    gap_before, gap_after = (logp.detach() - ref).abs(), (stepped - ref).abs()
    assert gap_after[0, 0] < gap_before[0, 0] and gap_after[0, 1] < gap_before[0, 1]
    assert logp.grad[0, 2] == 0  # already at the parent: no pull


def test_kl_coef_zero_is_exactly_the_loss_and_gradient_without_the_term():
    ref = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    args = (torch.tensor([0.7]), torch.ones(1, 3), torch.tensor([0.5]))
    grads = []
    for with_ref in (False, True):
        logp = torch.log(torch.tensor([[0.4, 0.25, 0.3]])).requires_grad_()
        old = logp.detach() + 0.05
        parts = policy_loss(logp, old, old, *args, loss_config(kl_coef=0.0), ref if with_ref else None)
        parts.loss.backward()
        grads.append((float(parts.loss.detach()), logp.grad.clone(), parts.metrics()["kl"]))
    assert grads[0][0] == grads[1][0] and torch.equal(grads[0][1], grads[1][1]) and grads[1][2] == 0.0


def test_kl_changes_nothing_at_the_parent_and_pulls_back_once_the_policy_moved(tiny_model_dir):
    rows, adv = batch()
    off = Trainer(tiny_model_dir, trainer_config(lr=5e-2, loss=loss_config(kl_coef=0.0)))
    on = Trainer(tiny_model_dir, trainer_config(lr=5e-2, loss=loss_config(kl_coef=1.0)))
    assert off.ref_model is None  # kl_coef 0 never loads a parent copy
    first_off, first_on = off.step(rows, adv), on.step(rows, adv)
    # first step: policy == parent, so k3 and its gradient are exactly 0 and the updates are identical
    assert first_on["kl"] == 0.0 and first_off["loss"] == first_on["loss"]
    assert all(torch.equal(v, on.state_dict()[k]) for k, v in off.state_dict().items())
    for _ in range(3):
        off.step(rows, adv)
        on.step(rows, adv)

    def gap(trainer: Trainer) -> float:
        parent = Trainer(tiny_model_dir, trainer_config(loss=loss_config(kl_coef=0.0)))
        prep = parent.prepare(rows, adv)
        with torch.no_grad():
            return sum(
                float(((response_logprobs(trainer.model, mb) - response_logprobs(parent.model, mb)) * mb.mask)
                      .abs().sum())
                for mb in prep.batches
            )  # fmt: skip

    assert on.step(rows, adv)["kl"] > 0
    assert gap(on) < 0.8 * gap(off)
