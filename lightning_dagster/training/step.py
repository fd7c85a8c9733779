"""One RL step through the real runner and gateway (`rl_step`) and the held-out evaluation. The pipeline's
`rollouts` and `training_transitions` stages run the step's two halves (`sample_step`, `batch_transitions`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING

from lightning_dagster.training.advantages import AdvantageMode, Advantages, RolloutReward, compute_advantages
from lightning_dagster.training.transitions import TransitionConfig, merge_rollouts
from lightning_dagster.types import RolloutKind, Sampling

if TYPE_CHECKING:
    from lightning_dagster.runner.service import RolloutBatch, RolloutService
    from lightning_dagster.training.trainer import Trainer
    from lightning_dagster.training.transitions import ExcludedRollout, MergeStats, Row

EVAL_SAMPLING = Sampling(temperature=1.0)  # held-out success is judged on samples, where RL's effect shows
GREEDY = Sampling(temperature=0.0)


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """What one RL step samples and how its batch becomes training rows (`training.configs.step_settings`)."""

    group_size: int  # rollouts per task (one GRPO group)
    temperature: float  # the sampling temperature of every call of a train rollout
    advantage: AdvantageMode
    max_excluded_share: float  # rollouts with an invalid span a step may leave out (`merge_rollouts`)
    transitions: TransitionConfig = field(default_factory=TransitionConfig)


def step_seed(base_seed: int, step: int) -> int:
    """The sampling seed of RL step `step` (1-based): a re-run of the step samples the same rollouts."""
    return base_seed * 100_000 + step


def evaluate(service: RolloutService, tasks: list[dict], *, seed: int, tag: str, greedy: bool = True) -> dict:
    """Held-out success sampled at T=1.0 with the fixed evaluation seed (and greedy beside it)."""
    run = partial(service.run, tasks, group=1, kind=RolloutKind.holdout, seed=seed)
    sampled = run(sampling=EVAL_SAMPLING, tag=tag)
    out = {"success": sampled.success(), "eval_seconds": sampled.seconds, "tasks": len(tasks)}
    if greedy:
        g = run(sampling=GREEDY, tag=f"{tag}-greedy")
        out.update(greedy=g.success(), eval_seconds=out["eval_seconds"] + g.seconds)
    return out


def sample_step(
    service: RolloutService,
    tasks: list[dict],
    *,
    step: int,
    settings: StepSettings,
    base_seed: int,
    tag: str,
    snapshot_key: str | None = None,
) -> RolloutBatch:
    """The train batch of RL step `step`: every task `group_size` times at the step's temperature and seed."""
    return service.run(
        tasks,
        group=settings.group_size,
        kind=RolloutKind.train,
        sampling=Sampling(temperature=settings.temperature),
        seed=step_seed(base_seed, step),
        tag=tag,
        snapshot_key=snapshot_key,
    )


def batch_transitions(
    batch: RolloutBatch, settings: StepSettings
) -> tuple[list[Row], Advantages, dict[str, float | int], list[ExcludedRollout]]:
    """A batch's training rows, their rollouts' advantages (over the kept rollouts only), the merge
    statistics (`merge_*`) and the rollouts left out for an invalid span."""
    rows, rewards, stats = _rows_rewards_stats(batch, settings)
    merge = {f"merge_{k}": v for k, v in stats.to_dict().items()}
    return rows, compute_advantages(rewards, settings.advantage), merge, stats.excluded


def excluded_metrics(excluded: list[ExcludedRollout]) -> dict:
    """What a step's metrics name of its excluded rollouts (nothing when none was)."""
    return {"excluded": [asdict(e) for e in excluded]} if excluded else {}


def rl_step(
    service: RolloutService,
    trainer: Trainer,
    tasks: list[dict],
    *,
    step: int,
    settings: StepSettings,
    base_seed: int,
    tag: str,
    resource_id: str | None = None,
    snapshot_key: str | None = None,
) -> tuple[RolloutBatch, dict]:
    """One on-policy RL step: sample, rows and advantages, one update, serve the new weights."""
    batch = sample_step(
        service, tasks, step=step, settings=settings, base_seed=base_seed, tag=tag, snapshot_key=snapshot_key
    )
    rows, advantages, merge, excluded = batch_transitions(batch, settings)
    extra = {
        **merge,
        **excluded_metrics(excluded),
        "success": batch.success(),
        "rollout_seconds": batch.seconds,
        **({"failures": batch.failures} if batch.failures else {}),
    }
    metrics = trainer.step(rows, advantages, extra=extra)
    serve_policy(service, trainer, resource_id)
    return batch, metrics


def step_warnings(m: dict) -> list[str]:
    """What a step's metrics must say on screen: each failure reason of its rollouts (`runner.summary`), and
    a warning when no group had a learning signal (the step changed no weight)."""
    from lightning_dagster.runner.summary import failure_lines

    lines = failure_lines(m.get("failures") or {})
    if "groups" in m and m.get("skipped_groups") == m["groups"]:
        why = (
            f"in each of its {m['groups']} group(s) every rollout got the same reward (mean "
            f"{m['reward_mean']:.3f}), so every group was skipped"
            if m["groups"]
            else "no rollout posted a reward"
        )
        lines.append(f"warning: step {m['step']} had no learning signal: {why}; no weight changed")
    return lines


def rows_and_rewards(
    batch: RolloutBatch, settings: StepSettings
) -> tuple[list[Row], list[RolloutReward], dict[str, float | int]]:
    """The batch's training rows, one reward per kept rollout, and the merge statistics (`merge_*`)."""
    rows, rewards, stats = _rows_rewards_stats(batch, settings)
    return rows, rewards, {f"merge_{k}": v for k, v in stats.to_dict().items()}


def _rows_rewards_stats(
    batch: RolloutBatch, settings: StepSettings
) -> tuple[list[Row], list[RolloutReward], MergeStats]:
    candidates = [r for r in batch.rollouts if r.rollout_id in batch.rewards and r.rollout_id in batch.spans]
    pairs = ((r.rollout_id, batch.spans[r.rollout_id]) for r in candidates)
    kept, stats = merge_rollouts(pairs, settings.transitions, max_excluded_share=settings.max_excluded_share)
    rows = [row for r in candidates for row in kept.get(r.rollout_id, [])]
    rewards = [
        RolloutReward(r.rollout_id, r.group_id, batch.rewards[r.rollout_id])
        for r in candidates
        if r.rollout_id in kept
    ]
    return rows, rewards, stats


def serve_policy(service: RolloutService, trainer: Trainer, resource_id: str | None) -> None:
    """Have `service` serve the trainer's current policy (the adapter alone if the engine hot-loads one)."""
    # an engine serving adapters is pushed the adapter alone
    state = trainer.snapshot() if service.serves_adapters else trainer.state_dict()
    service.load_weights(state, resource_id)
