"""The policy loss: PPO clip with separate lower/upper epsilons, truncated importance sampling against the
recorded behaviour logprobs, a k3 KL to the exact parent (on by default), and three normalizations.

Per trained token t of row b (A_b is the rollout's advantage, broadcast):

    ratio  = exp(logp - old)                         old: the trainer's own logprobs before this update
    pg     = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    w_is   = min(exp(old - behaviour), tis_cap)      detached; per token, or one product per row
    kl     = exp(ref - logp) - (ref - logp) - 1      k3 estimator of KL(policy || parent)
    loss   = sum_b weight_b * sum_t mask * (w_is * pg + kl_coef * kl)

`weight_b` is fixed for the whole optimizer step by `row_weights`, before any micro-batching, so the loss
of k micro-batches adds up to exactly the loss of one pass over the step (and so do the gradients):

    token_mean            1 / (trained tokens in the step)
    seq_mean_token_mean   1 / (rollouts in the step * trained tokens of the rollout, over all its rows)
    constant              1 / C

The sequence of `seq_mean_token_mean` is the rollout, not the row: a rollout the merge split into several
rows (a prefix break, a `length` cut, a temperature change) still weighs 1 / rollouts, shared by its tokens,
exactly as if it had stayed one row. Weighing rows instead would give a rollout more say the more often its
merge broke. `token_mean` and `constant` weigh tokens, so splitting changes nothing there either.

The KL term keeps the policy near its exact parent (`ref`: a frozen copy of the parent, scored at each row's
temperature; the behaviour logprobs are the parent's only at the first step). In expectation over on-policy
samples its gradient is that of KL(parent || policy), which grows when the policy drops what the parent did:
the protected greedy cases a candidate must keep. `kl_coef = 0` leaves the update exactly as without it.

`constant` is Dr. GRPO's fixed denominator: C = rollouts per step * max response tokens reproduces its "sum
over a sequence / max response tokens, mean over sequences".
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch

Normalization = Literal["token_mean", "seq_mean_token_mean", "constant"]
NORMALIZATIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "constant")


class LossConfigError(ValueError):
    """A loss setting that cannot be used (unknown mode, missing or unread constant, bad cap)."""


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """The loss of one RL step; the fields without a default are the user's (`configs.loss_config`)."""

    kl_coef: float  # weight of the k3 KL to the parent; 0: off
    normalization: Normalization
    constant: float | None  # C of `constant` normalization: required there, refused elsewhere
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis: Literal["none", "token", "sequence"] = "token"
    tis_cap: float = 2.0
    # a per-token gap under this is weighed as none: the float noise batch mates give a logprob (~1e-7)
    tis_noise: float = 1e-4

    def __post_init__(self) -> None:
        mode, c = self.normalization, self.constant
        if mode not in NORMALIZATIONS:
            raise LossConfigError(f"unknown normalization {mode!r}; expected one of {NORMALIZATIONS}")
        if mode == "constant":
            if c is None or not math.isfinite(c) or c <= 0:
                raise LossConfigError(
                    f"normalization 'constant' needs a positive finite `constant`, got {c!r}"
                )
        elif c is not None:
            raise LossConfigError(f"`constant` ({c}) is only read by normalization 'constant', not {mode!r}")
        if self.tis not in ("none", "token", "sequence"):
            raise LossConfigError(f"unknown truncated importance sampling level {self.tis!r}")
        if self.tis_cap <= 0:
            raise LossConfigError("tis_cap must be positive")
        if not math.isfinite(self.kl_coef) or self.kl_coef < 0:
            raise LossConfigError(f"kl_coef must be a finite number >= 0, got {self.kl_coef!r}")


def row_weights(
    trained_tokens: Sequence[int],
    rollout_ids: Sequence[str],
    config: LossConfig,
    *,
    totals: tuple[int, int] | None = None,
) -> list[float]:
    """The per-token weight of every row of one optimizer step (see the module docstring). For one rank's
    share of the step, `totals` are the whole step's trained tokens and rollouts."""
    mode = config.normalization
    if mode == "token_mean":
        total = totals[0] if totals is not None else sum(trained_tokens)
        return [1.0 / total if total else 0.0 for _ in trained_tokens]
    if mode == "constant":
        assert config.constant is not None  # LossConfig refuses `constant` without one
        return [1.0 / config.constant for _ in trained_tokens]
    per_rollout: dict[str, int] = {}
    for rid, t in zip(rollout_ids, trained_tokens, strict=True):
        per_rollout[rid] = per_rollout.get(rid, 0) + t
    n = totals[1] if totals is not None else len(per_rollout)
    return [1.0 / (n * per_rollout[rid]) if per_rollout[rid] else 0.0 for rid in rollout_ids]


@dataclass
class LossParts:
    """Sums over one micro-batch; `merge` adds micro-batches up to the whole step."""

    loss: torch.Tensor
    tokens: float = 0.0
    clipped: float = 0.0
    kl_sum: float = 0.0
    is_ratio_sum: float = 0.0
    is_ratio_max: float = 0.0
    is_ratio_min: float = float("inf")
    is_capped: float = 0.0
    abs_log_ratio_max: float = 0.0
    abs_log_ratio_sum: float = 0.0  # |trainer - engine logprob| over the step's tokens (the engine gap)

    def merge(self, other: LossParts) -> LossParts:
        extremes = {"is_ratio_max": max, "is_ratio_min": min, "abs_log_ratio_max": max}
        merged = {
            f.name: extremes.get(f.name, operator.add)(getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if f.name != "loss"
        }
        return LossParts(loss=self.loss.detach() + other.loss.detach(), **merged)

    def metrics(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "loss": float(self.loss.detach()),
            "trained_tokens": self.tokens,
            "clip_fraction": self.clipped / n,
            "kl": self.kl_sum / n,
            "is_ratio_mean": self.is_ratio_sum / n,
            "is_ratio_max": self.is_ratio_max,
            "is_ratio_min": self.is_ratio_min if self.tokens else 1.0,
            "is_capped_fraction": self.is_capped / n,
            "abs_log_ratio_max": self.abs_log_ratio_max,
            "abs_log_ratio_mean": self.abs_log_ratio_sum / n,
        }


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> LossParts:
    """All token tensors are [B, L] and aligned; `advantages` and `weights` are [B] (one per row)."""
    mask = mask.to(logprobs.dtype)
    adv, old = advantages[:, None], old_logprobs.detach()
    ratio = torch.exp(logprobs - old)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)

    # Sampler vs trainer mismatch: the behaviour policy is what the engine actually sampled from.
    log_is = (old - behaviour_logprobs) * mask
    log_w = torch.where(log_is.abs() < config.tis_noise, 0.0, log_is)
    if config.tis == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
    is_ratio = torch.exp(log_w)
    w_is = torch.clamp(is_ratio, max=config.tis_cap) if config.tis != "none" else torch.ones_like(is_ratio)
    per_token = w_is.detach() * pg
    kl = torch.zeros_like(per_token)
    if config.kl_coef and ref_logprobs is not None:
        diff = ref_logprobs.detach() - logprobs
        kl = torch.exp(diff) - diff - 1.0
        per_token = per_token + config.kl_coef * kl
    loss = (weights[:, None] * mask * per_token).sum()

    with torch.no_grad():
        on = mask > 0
        token_ratio = torch.exp(log_is)[on]
        return LossParts(
            loss=loss,
            tokens=float(mask.sum()),
            clipped=float(((pg_clipped > pg_unclipped) & on).sum()),
            kl_sum=float((kl * mask).sum()),
            is_ratio_sum=float(token_ratio.sum()),
            is_ratio_max=float(token_ratio.max()) if token_ratio.numel() else 0.0,
            is_ratio_min=float(token_ratio.min()) if token_ratio.numel() else float("inf"),
            is_capped=float(((is_ratio > config.tis_cap) & on).sum()) if config.tis != "none" else 0.0,
            abs_log_ratio_max=float(log_is[on].abs().max()) if token_ratio.numel() else 0.0,
            abs_log_ratio_sum=float(log_is[on].abs().sum()),
        )
