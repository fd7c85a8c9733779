"""Rollout-level advantages: one number per rollout, broadcast to every row and token it became.

Modes, for rollouts sampled in groups (same task, `group_id`):
- `grpo`:    (r - mean(group)) / (std(group) + 1e-6)
- `dr_grpo`: r - mean(group)                                   (Dr. GRPO: no division by the std)
- `rloo`:    r - mean(group without r) = n/(n-1) * (r - mean)  (leave-one-out baseline)
- `whiten`:  (r - mean(batch)) / (std(batch) + eps), ignoring groups
Rollouts without a group (`serve` traffic) are always whitened together over the batch. A group whose
rewards are all equal carries no signal: its rollouts get no advantage at all (counted in `skipped_*`),
and the trainer leaves their rows out entirely. std is the population std.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

AdvantageMode = Literal["grpo", "dr_grpo", "rloo", "whiten"]
MODES: tuple[str, ...] = ("grpo", "dr_grpo", "rloo", "whiten")


class AdvantageError(ValueError):
    """Inconsistent input: a rollout listed twice, a non-finite reward, or an unknown mode."""


@dataclass(frozen=True)
class RolloutReward:
    rollout_id: str
    group_id: str | None
    reward: float


@dataclass
class Advantages:
    values: dict[str, float]  # rollout_id -> advantage; rollouts of skipped groups are absent
    groups: int = 0
    skipped_groups: int = 0
    skipped_rollouts: int = 0
    reward_mean: float = 0.0
    group_stats: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # group -> (n, mean, std)

    def to_dict(self) -> dict[str, float | int]:
        return {
            "groups": self.groups,
            "skipped_groups": self.skipped_groups,
            "skipped_rollouts": self.skipped_rollouts,
            "reward_mean": self.reward_mean,
            "advantage_rollouts": len(self.values),
        }


def _unique(rewards: Iterable[RolloutReward]) -> list[RolloutReward]:
    """One entry per rollout: a rollout that became several rows may be listed once per row."""
    seen: dict[str, RolloutReward] = {}
    for r in rewards:
        if not isinstance(r.reward, int | float) or not math.isfinite(r.reward):
            raise AdvantageError(f"rollout {r.rollout_id}: reward {r.reward!r} is not a finite number")
        if (old := seen.setdefault(r.rollout_id, r)) != r:
            raise AdvantageError(f"rollout {r.rollout_id} listed as {old} and as {r}")
    return list(seen.values())


def _mean_std(xs: list[float]) -> tuple[float, float]:
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def _group_values(rewards: list[float], mean: float, std: float, mode: str) -> list[float] | None:
    """Advantages of one group, or None when the group has no variance."""
    if max(rewards) - min(rewards) <= 1e-12:
        return None
    if mode in ("grpo", "whiten"):
        return [(r - mean) / (std + 1e-6) for r in rewards]
    if mode == "dr_grpo":
        return [r - mean for r in rewards]
    n = len(rewards)  # rloo
    return [r - (mean * n - r) / (n - 1) for r in rewards]


def compute_advantages(rewards: Iterable[RolloutReward], mode: AdvantageMode = "grpo") -> Advantages:
    if mode not in MODES:
        raise AdvantageError(f"unknown advantage mode {mode!r}; expected one of {MODES}")
    items = _unique(rewards)
    groups: dict[str | None, list[RolloutReward]] = {}
    for r in items:
        key = None if mode == "whiten" else r.group_id
        groups.setdefault(key, []).append(r)
    out = Advantages(values={}, groups=len(groups))
    out.reward_mean = sum(r.reward for r in items) / len(items) if items else 0.0
    for key, members in groups.items():
        values = [m.reward for m in members]
        mean, std = _mean_std(values)
        if key is not None:
            out.group_stats[key] = (len(members), mean, std)
        advs = _group_values(values, mean, std, "whiten" if key is None else mode)
        if advs is None:
            out.skipped_groups += 1
            out.skipped_rollouts += len(members)
            continue
        out.values.update(zip((m.rollout_id for m in members), advs, strict=True))
    return out
