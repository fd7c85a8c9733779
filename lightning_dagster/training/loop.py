"""RL through the real runner and gateway: rollouts of the harness, their recorded spans, one update per step.

one RL step (`rl_step`, also the pipeline's steps):
    enqueue tasks x group train rollouts sampled with `Sampling(temperature)` and seed `step_seed(base, step)`
    -> RolloutService (Runner -> LocalGateway -> engine) -> each rollout's final successful attempt
    -> spans merged into rows, rewards -> rollout-level advantages -> one trainer step
    -> load_weights(new weights), so the next step samples from the new policy
every `eval_every` steps: held-out success sampled at T=1.0 with one fixed evaluation seed (common random
numbers: the gateway derives each call's seed from the rollout's `sampling_seed`), greedy beside it.
every `validation.every` steps and the last: the checkpoint decoded greedily on the validation split
(`CheckpointKeeper`); the run proposes the checkpoint `selection.select` picks and may stop early.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_dagster.project import load_project, load_tasks
from lightning_dagster.project.examples import example_file
from lightning_dagster.project.harness import harness_spec
from lightning_dagster.runner.service import RolloutBatch, RolloutService
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store
from lightning_dagster.training import distributed
from lightning_dagster.training.advantages import AdvantageMode, Advantages, RolloutReward, compute_advantages
from lightning_dagster.training.selection import (
    CheckpointEval,
    EmptyValidationSplit,
    Selection,
    ValidationSettings,
    judge,
    select,
    solved_cases,
    stop_reason,
    train_tasks,
    validation_split,
)
from lightning_dagster.training.trainer import Trainer, TrainerConfig
from lightning_dagster.training.transitions import (
    ExcludedRollout,
    MergeStats,
    Row,
    TransitionConfig,
    merge_rollouts,
)
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
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    seed: int = 0  # task pools and the base of every step's sampling seed (`step_seed`)
    parallel: int = 64
    # The gateway + engine in a child process: faster rollouts on calc (benchmarks/README.md, training).
    serving: Literal["thread", "process"] = "process"
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
) -> tuple[list[Row], Advantages, dict[str, float | int], list[ExcludedRollout]]:
    """A batch's training rows, their rollouts' advantages, the merge statistics (`merge_*`) and the rollouts
    left out for an invalid span (`transitions.merge_rollouts`): advantages are computed over the kept
    rollouts only, so an excluded one weighs on no group's mean or std."""
    rows, rewards, stats = _rows_rewards_stats(batch, settings.transitions)
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
    """One on-policy RL step: sample, build rows and advantages, one trainer update, then serve the new
    weights as `resource_id`. Returns the batch and the trainer's metrics (with `success`, the batch's mean
    reward counting unfinished rollouts as 0, and `rollout_seconds`)."""
    batch = sample_step(
        service, tasks, step=step, settings=settings, base_seed=base_seed, tag=tag, snapshot_key=snapshot_key
    )
    rows, advantages, merge, excluded = batch_transitions(batch, settings)
    extra = {
        **merge,
        **excluded_metrics(excluded),
        "success": batch.success(),
        "rollout_seconds": batch.seconds,
    }
    metrics = trainer.step(rows, advantages, extra=extra)
    service.load_weights(trainer.state_dict(), resource_id)
    return batch, metrics


def rows_and_rewards(
    batch: RolloutBatch, config: TransitionConfig
) -> tuple[list[Row], list[RolloutReward], dict[str, float | int]]:
    """The batch's training rows and one reward per rollout (only rollouts with both, and none excluded for
    an invalid span), and the merge statistics (`merge_*`)."""
    rows, rewards, stats = _rows_rewards_stats(batch, config)
    return rows, rewards, {f"merge_{k}": v for k, v in stats.to_dict().items()}


def _rows_rewards_stats(
    batch: RolloutBatch, config: TransitionConfig
) -> tuple[list[Row], list[RolloutReward], MergeStats]:
    candidates = [r for r in batch.rollouts if r.rollout_id in batch.rewards and r.rollout_id in batch.spans]
    kept, stats = merge_rollouts(((r.rollout_id, batch.spans[r.rollout_id]) for r in candidates), config)
    rows = [row for r in candidates for row in kept.get(r.rollout_id, [])]
    rewards = [
        RolloutReward(r.rollout_id, r.group_id, batch.rewards[r.rollout_id])
        for r in candidates
        if r.rollout_id in kept
    ]
    return rows, rewards, stats


# ----------------------------------------------------------------------------------------------------------
# validation and checkpoint selection


def greedy_solved(
    service: RolloutService, tasks: list[dict], *, seed: int, tag: str, threshold: float
) -> frozenset[str]:
    """The validation cases the served model solves greedily. These rollouts carry no snapshot key: they are
    the trainer's own evidence, not part of the snapshot's planned rollouts."""
    batch = service.run(tasks, group=1, kind=RolloutKind.validation, sampling=GREEDY, seed=seed, tag=tag)
    return solved_cases({r.task_id: batch.rewards.get(r.rollout_id) for r in batch.rollouts}, threshold)


class CheckpointKeeper:
    """Judges checkpoints on the validation split as training goes, keeps the weights of the one
    `selection.select` proposes, and says when validation regressed for `patience` evaluations in a row.
    Built while `service` serves the parent (it is judged first); after each step the service must serve
    the trainer's current weights."""

    def __init__(
        self, service: RolloutService, tasks: list[dict], settings: ValidationSettings, *, seed: int, tag: str
    ) -> None:
        if not tasks:
            raise EmptyValidationSplit(
                "the validation split is empty: the run trains on every task of the train split; lower "
                "steps x tasks per step, or set validation tasks to 0"
            )
        self.service, self.tasks, self.settings, self.seed, self.tag = service, tasks, settings, seed, tag
        self.parent_solved = self._solved("parent")
        self.parent_success = len(self.parent_solved) / len(tasks)
        self.evals: list[CheckpointEval] = []
        self.kept: dict | None = None
        self.early_stop: str | None = None

    def _solved(self, name: str) -> frozenset[str]:
        return greedy_solved(
            self.service,
            self.tasks,
            seed=self.seed,
            tag=f"{self.tag}-val-{name}",
            threshold=self.settings.success_threshold,
        )

    def after_step(self, step: int, last_step: int, trainer: Trainer) -> CheckpointEval | None:
        """Judge checkpoint `step` if it is due; returns its evaluation (None: not due)."""
        if not self.settings.due(step, last_step):
            return None
        ev = judge(step, self._solved(f"s{step}"), self.parent_solved, len(self.tasks))
        self.evals.append(ev)
        if select(self.evals).step == step:
            self.kept = trainer.state_dict()
        # at the last step there is nothing left to stop: the run simply ended
        stop = stop_reason(self.evals, self.parent_success, self.settings.patience)
        self.early_stop = stop if step < last_step else None
        return ev

    def restore(self, trainer: Trainer) -> Selection:
        """Put the proposed checkpoint's weights into the trainer; returns the selection."""
        chosen = select(self.evals)
        assert self.kept is not None  # `select` chose an evaluated step, whose weights were kept then
        if chosen.step != self.evals[-1].step:
            trainer.model.load_state_dict(self.kept)
        return chosen


NO_VALIDATION_CASES = (
    "no checkpoint selection: the run trains on every task of its train split, so none is left to validate "
    "on (add train tasks, or lower steps x tasks per step); the last checkpoint is the candidate"
)


def selection_summary(
    kl_coef: float,
    steps_run: int,
    keeper: CheckpointKeeper | None,
    chosen: Selection | None,
    *,
    asked: int = 0,
) -> dict[str, Any]:
    """What a run records of its regularization and choice: the KL weight, the steps it ran, the validation
    size, the parent's and every checkpoint's validation, the proposed step and why, and any early stop.
    Without validation the last checkpoint is the candidate; when `asked` validation tasks and none was left
    to validate on, `selection` says so."""
    if keeper is None or chosen is None:
        summary = {"kl_coef": kl_coef, "steps_run": steps_run, "validation_tasks": 0, "chosen_step": steps_run,
                   "early_stop": None}  # fmt: skip
        return summary | ({"selection": NO_VALIDATION_CASES} if asked else {})
    return {
        "kl_coef": kl_coef,
        "steps_run": steps_run,
        "validation_tasks": len(keeper.tasks),
        "parent_validation_success": keeper.parent_success,
        "parent_solved": len(keeper.parent_solved),
        "checkpoints": [e.to_dict() for e in keeper.evals],
        "chosen_step": chosen.step,
        "kept_parent_cases": chosen.kept_parent_cases,
        "selection": chosen.reason,
        "early_stop": keeper.early_stop,
    }


@dataclass
class RLResult:
    parent: dict
    candidate: dict  # the evaluation of the proposed checkpoint, with its `step`
    curve: list[dict]  # one entry per evaluation: step, rl_seconds, success (and greedy when measured)
    steps: list[dict]  # trainer metrics per step
    seconds: float
    rl_seconds: float
    checkpoint: Path | None
    # kl_coef, validation size, every checkpoint's validation, the chosen step, why training stopped early
    selection: dict[str, Any]


def train_rl(
    store: Store,
    parent_dir: Path | str,
    config: RLConfig,
    *,
    parent_resource_id: str | None = None,
    out_dir: Path | str | None = None,
    log: Any = None,
    group: distributed.Group | None = None,
) -> RLResult:
    """RL from `parent_dir`; returns the evaluations, per-step metrics, the checkpoint selection and (with
    `out_dir`) the proposed checkpoint. With `group` this is rank 0 of a process group: every step is also
    trained by the other ranks (`distributed.follow`), released when training ends."""
    started = time.perf_counter()
    project = load_project(config.project)
    tasks = load_tasks(project)
    tasks.require_splits(["train", "holdout"])
    harness = harness_spec(project)
    heldout = tasks.draw("holdout", config.heldout_tasks, config.seed)
    train_pool = train_tasks(
        tasks, config.steps * config.tasks_per_step, config.seed,
        validation=config.validation.tasks, eval_seed=config.eval_seed,
    )  # fmt: skip
    validation = validation_split(tasks, config.validation.tasks, config.eval_seed, train_pool)
    trainer = Trainer(parent_dir, config.trainer, group=group)
    curve: list[dict] = []
    metrics: list[dict] = []
    rl_seconds = 0.0
    chosen: Selection | None = None

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
        serving=ServingSettings(parallel=config.parallel, runner_mode=config.runner_mode),
        child=config.serving == "process",
    ) as service:
        parent = record(0, greedy=True)
        keeper = (
            CheckpointKeeper(service, validation, config.validation, seed=config.eval_seed, tag="rl")
            if validation  # empty when no validation is asked for, or no train task is left for it
            else None
        )
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
            if keeper is not None and (ev := keeper.after_step(step, config.steps, trainer)) is not None:
                m.update(validation_success=ev.success, validation_lost_parent_cases=len(ev.lost))
            metrics.append(m)
            if log:
                log(m)
            stop = keeper is not None and keeper.early_stop is not None
            last = step == config.steps or stop
            if last or step % config.eval_every == 0:
                record(step, greedy=last or config.greedy_every_eval)
            if stop:
                break
        candidate = curve[-1]
        if keeper is not None:
            chosen = keeper.restore(trainer)
            if chosen.step != candidate["step"]:
                service.load_weights(trainer.state_dict())
                ev = evaluate(service, heldout, seed=config.eval_seed, tag=f"candidate{chosen.step}")
                candidate = {"step": chosen.step, "rl_seconds": rl_seconds, **ev}
    if group is not None:
        distributed.release(group)
    checkpoint = trainer.save(out_dir) if out_dir is not None else None
    return RLResult(
        parent=parent,
        candidate=candidate,
        curve=curve,
        steps=metrics,
        seconds=time.perf_counter() - started,
        rl_seconds=rl_seconds,
        checkpoint=checkpoint,
        selection=selection_summary(
            config.trainer.loss.kl_coef, len(metrics), keeper, chosen, asked=config.validation.tasks
        ),
    )
