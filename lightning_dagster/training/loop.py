"""The RL loop: `train_rl`, the one loop `lightning-dagster train`, the pipeline's `candidate_resource` and
its Pipes child run, each keeping only its own bookkeeping.

    trainer <- the parent checkpoint (rank 0 of a process group first sends it to every follower)
    step 1 on a batch sampled before the run, when one is given (`FirstBatch`)
    holdout: the parent's success at T=1.0 with the evaluation seed, greedy beside it
    validation: the parent decoded greedily (`CheckpointKeeper`)
    for step in 1..steps:
        `rl_step` with `step_seed(base_seed, step)`: sample, rows, advantages, one update, serve the weights
        validation every `validation_every` steps and the last; stop after `validation_patience`
            evaluations in a row that regressed
        holdout every `eval_every` steps and the last (greedy at the last)
    restore the checkpoint `selection.select` proposes; holdout on it when it is not the last; save
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.training import distributed
from lightning_dagster.training.configs import step_settings, trainer_config, validation_settings
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
from lightning_dagster.training.step import GREEDY, evaluate, rl_step, serve_policy
from lightning_dagster.training.trainer import Trainer
from lightning_dagster.types import RolloutKind

if TYPE_CHECKING:
    from lightning_dagster.project import TaskSet
    from lightning_dagster.runner.service import RolloutService
    from lightning_dagster.settings import TrainingSettings
    from lightning_dagster.training.advantages import Advantages
    from lightning_dagster.training.transitions import Row


@dataclass(frozen=True)
class Pools:
    """The tasks of one run: `train` in step order; `validation` empty: the last checkpoint is the
    candidate; `holdout` empty: no held-out evaluation (the pipeline evaluates in its own asset)."""

    train: list[dict]
    validation: list[dict] = field(default_factory=list)
    holdout: list[dict] = field(default_factory=list)


def draw_pools(
    tasks: TaskSet, t: TrainingSettings, *, train: list[dict] | None = None, holdout: bool = True
) -> Pools:
    """A run's pools: `train` (default: `steps x tasks_per_step` drawn with the seed, never a validation
    case), the validation cases it leaves, and `holdout_tasks` drawn with the evaluation seed."""
    if train is None:
        n = t.steps * t.tasks_per_step
        train = train_tasks(tasks, n, t.seed, validation=t.validation_tasks, eval_seed=t.eval_seed)
    validation = validation_split(tasks, t.validation_tasks, t.eval_seed, train)
    return Pools(train, validation, tasks.draw("holdout", t.holdout_tasks, t.eval_seed) if holdout else [])


@dataclass(frozen=True)
class FirstBatch:
    """Step 1's batch, sampled and merged before the run (the pipeline's `training_transitions`)."""

    rows: list[Row]
    advantages: Advantages
    metrics: dict[str, Any]  # what step 1's metrics record of it (merge statistics, excluded rollouts)


@dataclass
class RLResult:
    parent: dict | None  # the parent's held-out evaluation (None: no holdout pool)
    candidate: dict | None  # the evaluation of the proposed checkpoint, with its `step`
    curve: list[dict]  # one entry per evaluation: step, rl_seconds, success (and greedy when measured)
    steps: list[dict]  # trainer metrics per step
    seconds: float
    rl_seconds: float
    checkpoint: Path | None
    # kl_coef, validation size, every checkpoint's validation, the chosen step, why training stopped early
    selection: dict[str, Any]


def train_rl(
    parent_dir: Path | str,
    t: TrainingSettings,
    pools: Pools,
    serve: Callable[[], AbstractContextManager[RolloutService]],
    *,
    base_seed: int,
    first: FirstBatch | None = None,
    tag: str = "rl",
    snapshot_key: str | None = None,
    candidate_id: str | None = None,
    out_dir: Path | str | None = None,
    log: Callable[[dict], None] | None = None,
    group: distributed.Group | None = None,
) -> RLResult:
    """RL from `parent_dir` as the module docstring says. `serve()` starts the parent's service (entered
    only when something samples); the weights after step s are served as `<candidate_id>@s`. With `out_dir`
    the proposed checkpoint is saved there; with `group` this is rank 0 of a process group."""
    started = time.perf_counter()
    step_config, validation, config = step_settings(t), validation_settings(t), trainer_config(t)
    if group is not None:  # the one payload every follower takes (`followed`)
        distributed.broadcast((Path(parent_dir), config), group)
    trainer = Trainer(parent_dir, config, group=group)
    metrics = [trainer.step(first.rows, first.advantages, extra=dict(first.metrics))] if first else []
    curve: list[dict] = []
    keeper: CheckpointKeeper | None = None
    chosen: Selection | None = None
    rl_seconds = 0.0

    def served_as(step: int) -> str | None:
        return f"{candidate_id}@{step}" if candidate_id else None

    def holdout(service: RolloutService, step: int, *, greedy: bool, on_curve: bool = True) -> dict:
        point = {"step": step, "rl_seconds": rl_seconds}
        point |= evaluate(service, pools.holdout, seed=t.eval_seed, tag=f"{tag}-eval{step}", greedy=greedy)
        if on_curve:
            curve.append(point)
            if log:
                log(point)
        return point

    samples = t.steps > len(metrics) or bool(pools.validation) or bool(pools.holdout)
    with serve() if samples else contextlib.nullcontext() as service:
        if pools.holdout:
            holdout(service, 0, greedy=True)
        if pools.validation:
            keeper = CheckpointKeeper(service, pools.validation, validation, seed=t.eval_seed, tag=tag)
        for step in range(1, t.steps + 1):
            clock = time.perf_counter()
            if step <= len(metrics):  # trained before the run: serve its update
                m = metrics[step - 1]
                if service is not None:
                    serve_policy(service, trainer, served_as(step))
            else:
                tasks = pools.train[(step - 1) * t.tasks_per_step : step * t.tasks_per_step]
                _, m = rl_step(service, trainer, tasks, step=step, settings=step_config, base_seed=base_seed,
                               tag=f"{tag}-s{step}", resource_id=served_as(step), snapshot_key=snapshot_key)  # fmt: skip
                metrics.append(m)
            rl_seconds += time.perf_counter() - clock
            m["rl_seconds"] = rl_seconds
            if keeper is not None and (ev := keeper.after_step(step, t.steps, trainer)) is not None:
                m.update(validation_success=ev.success, validation_lost_parent_cases=len(ev.lost))
            if log:
                log(m)
            last = step == t.steps or (keeper is not None and keeper.early_stop is not None)
            if pools.holdout and (last or step % t.eval_every == 0):
                holdout(service, step, greedy=last)
            if last:
                break
        candidate = curve[-1] if curve else None
        if keeper is not None:
            chosen = keeper.restore(trainer)
            if candidate is not None and chosen.step != candidate["step"]:
                serve_policy(service, trainer, served_as(chosen.step))
                candidate = holdout(service, chosen.step, greedy=True, on_curve=False)
    if group is not None:
        distributed.release(group)
    return RLResult(
        parent=curve[0] if curve else None,
        candidate=candidate,
        curve=curve,
        steps=metrics,
        seconds=time.perf_counter() - started,
        rl_seconds=rl_seconds,
        checkpoint=trainer.save(out_dir) if out_dir is not None else None,
        selection=selection_summary(t.kl_coef, len(metrics), keeper, chosen, asked=t.validation_tasks),
    )


# ------------------------------------------------------------------------------------------- the other ranks


def join(device: str) -> distributed.Group | None:
    """This process's place among the ranks `torchrun` started; None in a single process."""
    from lightning_dagster.engine.engine import resolve_device

    return None if distributed.launched_world_size() == 1 else distributed.join(resolve_device(device))


def followed(group: distributed.Group | None) -> bool:
    """On ranks 1..: train every step rank 0's `train_rl` drives until it releases this rank, then True.
    On rank 0, or in a single process: False at once (the caller runs `train_rl`)."""
    if group is None or group.leader:
        return False
    parent_dir, config = distributed.broadcast(None, group)
    distributed.follow(Trainer(parent_dir, config, group=group))
    return True


# ----------------------------------------------------------------------- validation and checkpoint selection


class CheckpointKeeper:
    """Judges checkpoints on the validation split as training goes, keeps the weights of the one
    `selection.select` proposes, and says when to stop early. Built while `service` serves the parent."""

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
        """The validation cases the served model solves greedily (rollouts outside any snapshot)."""
        tag, kind = f"{self.tag}-val-{name}", RolloutKind.validation
        batch = self.service.run(self.tasks, group=1, kind=kind, sampling=GREEDY, seed=self.seed, tag=tag)
        rewards = {r.task_id: batch.rewards.get(r.rollout_id) for r in batch.rollouts}
        return solved_cases(rewards, self.settings.success_threshold)

    def after_step(self, step: int, last_step: int, trainer: Trainer) -> CheckpointEval | None:
        """Judge checkpoint `step` if it is due; returns its evaluation (None: not due)."""
        if not self.settings.due(step, last_step):
            return None
        ev = judge(step, self._solved(f"s{step}"), self.parent_solved, len(self.tasks))
        self.evals.append(ev)
        if select(self.evals).step == step:
            self.kept = trainer.snapshot()
        # at the last step there is nothing left to stop: the run simply ended
        stop = stop_reason(self.evals, self.parent_success, self.settings.patience)
        self.early_stop = stop if step < last_step else None
        return ev

    def restore(self, trainer: Trainer) -> Selection:
        """Put the proposed checkpoint's weights into the trainer."""
        chosen = select(self.evals)
        assert self.kept is not None  # `select` chose an evaluated step, whose weights were kept then
        if chosen.step != self.evals[-1].step:
            trainer.restore(self.kept)
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
    """What a run records of its regularization and checkpoint choice."""
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
