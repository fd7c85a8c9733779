"""RL through the real runner and gateway: rollouts of the harness, their recorded spans, one update per step.

one RL step (`rl_step`, also the pipeline's steps):
    enqueue tasks x group train rollouts sampled with `Sampling(temperature)` and seed `step_seed(base, step)`
    -> RolloutService (Runner -> LocalGateway -> engine) -> each rollout's final successful attempt
    -> spans merged into rows, rewards -> rollout-level advantages -> one trainer step
    -> load_weights(new weights), so the next step samples from the new policy
every `eval_every` steps: held-out success sampled at T=1.0 with one fixed evaluation seed (common random
numbers: the gateway derives each call's seed from the rollout's `sampling_seed`), greedy beside it.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_dagster.gateway.local import Serving
from lightning_dagster.project import load_project, load_tasks
from lightning_dagster.project.examples import example_file
from lightning_dagster.project.harness import harness_spec
from lightning_dagster.runner.service import RolloutBatch, RolloutService
from lightning_dagster.store import Store
from lightning_dagster.training.advantages import AdvantageMode, Advantages, RolloutReward, compute_advantages
from lightning_dagster.training.trainer import Trainer, TrainerConfig
from lightning_dagster.training.transitions import Row, TransitionConfig, merge_calls
from lightning_dagster.types import RolloutKind, Sampling

EVAL_SAMPLING = Sampling(temperature=1.0)  # held-out success is judged on samples, where RL's effect shows
GREEDY = Sampling(temperature=0.0)


@dataclass(frozen=True)
class StepSettings:
    """What one RL step samples and how its batch becomes training rows; shared by `train_rl` and the
    pipeline."""

    group_size: int = 16  # rollouts per task (one GRPO group)
    temperature: float = 1.0  # the sampling temperature of every call of a train rollout
    advantage: AdvantageMode = "grpo"
    transitions: TransitionConfig = field(default_factory=TransitionConfig)


@dataclass
class RLConfig:
    # the project file: its harness runs, its train split is sampled, its holdout split evaluates
    project: str = field(default_factory=lambda: str(example_file("calc")))
    steps: int = 40
    tasks_per_step: int = 16
    step: StepSettings = field(default_factory=StepSettings)
    eval_every: int = 10  # also evaluated before the first step and after the last
    heldout_tasks: int = 300
    eval_seed: int = 20261130
    greedy_every_eval: bool = False  # greedy only for the parent and the final candidate unless set
    seed: int = 0  # task pools and the base of every step's sampling seed (`step_seed`)
    parallel: int = 64
    # The gateway + engine in a child process: faster rollouts on calc (benchmarks/README.md, training).
    serving: Serving = "process"
    runner_mode: Literal["inprocess", "subprocess"] = "inprocess"
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def step_seed(base_seed: int, step: int) -> int:
    """The sampling seed of RL step `step` (1-based) from a run's base seed: the only seed rule, so a
    re-run of the same step samples exactly the same rollouts."""
    return base_seed * 100_000 + step


# ----------------------------------------------------------------------------------------------------------
# evaluation and one RL step


def evaluate(service: RolloutService, tasks: list[dict], *, seed: int, tag: str, greedy: bool = True) -> dict:
    """Held-out success sampled at T=1.0 with the fixed evaluation seed (and greedy beside it)."""
    sampled = service.run(
        tasks, group=1, kind=RolloutKind.holdout, sampling=EVAL_SAMPLING, seed=seed, tag=tag
    )
    out = {"success": sampled.success(), "eval_seconds": sampled.seconds, "tasks": len(tasks)}
    if greedy:
        g = service.run(
            tasks, group=1, kind=RolloutKind.holdout, sampling=GREEDY, seed=seed, tag=f"{tag}-greedy"
        )
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
) -> tuple[list[Row], Advantages, dict[str, float | int]]:
    """A batch's training rows, their rollouts' advantages, and the merge statistics (`merge_*`)."""
    rows, rewards, merge = rows_and_rewards(batch, settings.transitions)
    return rows, compute_advantages(rewards, settings.advantage), merge


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
    """One on-policy RL step: sample, build rows and advantages, one trainer update, then serve the new
    weights as `resource_id`. Returns the batch and the trainer's metrics (with `success`, the batch's mean
    reward counting unfinished rollouts as 0, and `rollout_seconds`)."""
    batch = sample_step(
        service, tasks, step=step, settings=settings, base_seed=base_seed, tag=tag, snapshot_key=snapshot_key
    )
    rows, advantages, merge = batch_transitions(batch, settings)
    metrics = trainer.step(
        rows, advantages, extra={**merge, "success": batch.success(), "rollout_seconds": batch.seconds}
    )
    service.load_weights(trainer.state_dict(), resource_id)
    return batch, metrics


def rows_and_rewards(
    batch: RolloutBatch, config: TransitionConfig
) -> tuple[list[Row], list[RolloutReward], dict[str, float | int]]:
    """The batch's training rows and one reward per rollout (only rollouts with both)."""
    rows: list[Row] = []
    rewards: list[RolloutReward] = []
    stats = None
    for r in batch.rollouts:
        if r.rollout_id not in batch.rewards or r.rollout_id not in batch.spans:
            continue
        attempt_rows, s = merge_calls(batch.spans[r.rollout_id], config)
        if stats is None:
            stats = s
        else:
            stats.add(s)
        rows.extend(attempt_rows)
        rewards.append(RolloutReward(r.rollout_id, r.group_id, batch.rewards[r.rollout_id]))
    merge = stats.to_dict() if stats is not None else {}
    return rows, rewards, {f"merge_{k}": v for k, v in merge.items()}


@dataclass
class RLResult:
    parent: dict
    candidate: dict
    curve: list[dict]  # one entry per evaluation: step, rl_seconds, success (and greedy when measured)
    steps: list[dict]  # trainer metrics per step
    seconds: float
    rl_seconds: float
    checkpoint: Path | None


def train_rl(
    store: Store,
    parent_dir: Path | str,
    config: RLConfig,
    *,
    parent_resource_id: str | None = None,
    out_dir: Path | str | None = None,
    log: Any = None,
) -> RLResult:
    """RL from `parent_dir`; returns the evaluations, per-step metrics and (with `out_dir`) the checkpoint."""
    started = time.perf_counter()
    project = load_project(config.project)
    tasks = load_tasks(project)
    tasks.require_splits(["train", "holdout"])
    harness = harness_spec(project)
    heldout = tasks.draw("holdout", config.heldout_tasks, config.seed)
    train_pool = tasks.draw("train", config.steps * config.tasks_per_step, config.seed)
    trainer = Trainer(parent_dir, config.trainer)
    curve: list[dict] = []
    metrics: list[dict] = []
    rl_seconds = 0.0

    def record(step: int, greedy: bool) -> dict:
        ev = evaluate(service, heldout, seed=config.eval_seed, tag=f"eval{step}", greedy=greedy)
        point = {"step": step, "rl_seconds": rl_seconds, **ev}
        curve.append(point)
        if log:
            log(point)
        return point

    with RolloutService(
        store,
        parent_dir,
        harness=harness,
        resource_id=parent_resource_id,
        parallel=config.parallel,
        serving=config.serving,
        runner_mode=config.runner_mode,
    ) as service:
        parent = record(0, greedy=True)
        for step in range(1, config.steps + 1):
            t0 = time.perf_counter()
            _, m = rl_step(
                service,
                trainer,
                train_pool[(step - 1) * config.tasks_per_step : step * config.tasks_per_step],
                step=step,
                settings=config.step,
                base_seed=config.seed,
                tag=f"s{step}",
            )
            rl_seconds += time.perf_counter() - t0
            m["rl_seconds"] = rl_seconds
            metrics.append(m)
            if log:
                log(m)
            last = step == config.steps
            if last or step % config.eval_every == 0:
                record(step, greedy=last or config.greedy_every_eval)
        candidate = curve[-1]
    checkpoint = trainer.save(out_dir) if out_dir is not None else None
    return RLResult(
        parent=parent,
        candidate=candidate,
        curve=curve,
        steps=metrics,
        seconds=time.perf_counter() - started,
        rl_seconds=rl_seconds,
        checkpoint=checkpoint,
    )
