"""The graph's stages as the gate sees them: the evidence each produces, the rollout kinds it starts, and the
blocking checks that stop every stage after it. The names are the Dagster assets that produce the evidence
(a test keeps this and `assets.gate_checks.JUDGED_ASSET` equal).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.receipt_models import Receipt
from lightning_dagster.types import RolloutKind

# stage name -> why it did not run ("check 4 (held-out vs exact parent) failed upstream")
Causes = Mapping[str, str]
NO_CAUSES: Causes = MappingProxyType({})


@dataclass(frozen=True)
class Stage:
    name: str
    kinds: tuple[RolloutKind, ...]  # rollout kinds the stage starts
    blocking: tuple[Check, ...]  # blocking checks judged on its evidence: one not passing stops what follows
    has_evidence: Callable[[Receipt], bool]


ROLLOUTS, TRAINING, EVALUATION, CANARY, DRILL = (
    "rollouts",
    "candidate_resource",
    "holdout_evaluation",
    "canary_results",
    "rollback_drill",
)

# In graph order. The train kind is both `rollouts`' (the first batch) and training's (later steps).
STAGES: tuple[Stage, ...] = (
    Stage(
        ROLLOUTS,
        (RolloutKind.train,),
        (Check.retry_debt, Check.span_coverage),
        lambda r: r.rollouts is not None,
    ),
    Stage(TRAINING, (RolloutKind.train,), (Check.pinned,), lambda r: r.candidate is not None),
    Stage(
        EVALUATION,
        (RolloutKind.holdout, RolloutKind.protected),
        (Check.heldout_margin, Check.protected_cases),
        lambda r: r.holdout is not None or r.protected is not None,
    ),
    Stage(CANARY, (RolloutKind.canary,), (Check.canary_verified,), lambda r: r.canary is not None),
    Stage(DRILL, (), (Check.rollback_and_approval,), lambda r: r.rollback_drill is not None),
)
BY_NAME = {s.name: s for s in STAGES}


def ran(receipt: Receipt, name: str) -> bool:
    """Whether the stage left evidence: its section of the receipt, or rollouts of a kind only it starts."""
    stage = BY_NAME[name]
    if stage.has_evidence(receipt):
        return True
    own = set(stage.kinds) - {k for s in STAGES if s.name != name for k in s.kinds}
    return receipt.rollouts is not None and any(k in own for k in receipt.rollouts.kinds)


def first_batch_size(receipt: Receipt) -> int | None:
    """Train rollouts the first batch starts (`tasks_per_step` x `group_size`, when both are declared)."""
    algorithm = receipt.plan.algorithm
    tasks, group = algorithm.get("tasks_per_step"), algorithm.get("group_size")
    if type(tasks) is int and type(group) is int and tasks >= 0 and group >= 0:
        return tasks * group
    return None


def stop_causes(receipt: Receipt, statuses: Mapping[Check, str]) -> dict[str, str]:
    """For each stage that did not run, the blocking checks of the last stage that ran that did not pass."""
    causes: dict[str, str] = {}
    last_ran: Stage | None = None
    for stage in STAGES:
        if ran(receipt, stage.name):
            last_ran = stage
            continue
        if last_ran is None:
            continue
        stopped = [c for c in last_ran.blocking if statuses.get(c, "pass") != "pass"]
        if stopped:
            causes[stage.name] = upstream(stopped, statuses)
    return causes


def upstream(checks: list[Check], statuses: Mapping[Check, str]) -> str:
    parts = [
        f"check {int(c)} ({c.title}) {'failed' if statuses[c] == 'fail' else statuses[c]}" for c in checks
    ]
    return f"{' and '.join(parts)} upstream"


def not_run(name: str, causes: Causes, otherwise: str) -> str:
    """The finding for evidence a stage never produced: the stage and its cause, else `otherwise`."""
    return f"{name} did not run: {causes[name]}" if name in causes else otherwise


def _first_stop(regressed: list[bool], patience: int) -> int | None:
    """Where `patience` regressions in a row first end, in one pass (a forged long list costs linear time)."""
    run = 0
    for i, flag in enumerate(regressed):
        run = run + 1 if flag else 0
        if run >= patience:
            return i
    return None


@dataclass(frozen=True)
class EarlyStop:
    """Training's recorded early stop as the gate judges it (`problem`: validation does not justify it)."""

    not_started: int
    why: str
    problem: str | None = None


def early_stop(receipt: Receipt) -> EarlyStop | None:
    """Training's early stop (None: none), recomputed from its validation under the trainer's rule
    (`training.selection.stop_reason`), which must first hold at the last step run. One the evidence does not
    support leaves every planned rollout expected: a run cannot shorten its own plan by claiming one."""
    from lightning_dagster.training.selection import CheckpointEval, regressions

    run = receipt.candidate.training if receipt.candidate is not None else None
    if run is None or run.early_stop is None or run.steps_run >= run.steps_planned:
        return None
    batch = first_batch_size(receipt)
    planned = (receipt.plan.expected_rollouts or {}).get(RolloutKind.train)
    patience = receipt.plan.algorithm.get("validation_patience")
    evals = [CheckpointEval(v.step, v.success, tuple(v.lost)) for v in run.validation]
    parent = run.parent_validation_success
    why = f"stopped early after step {run.steps_run} of {run.steps_planned}: {run.early_stop}"
    problem = None
    if batch is None or planned != batch * run.steps_planned:
        problem = (
            f"{run.steps_planned} planned steps do not match the plan's {planned} expected train rollouts"
        )
    elif type(patience) is not int or patience < 1:
        problem = f"the plan's validation_patience {patience!r} never stops a run early"
    elif parent is None or not evals:
        problem = "no validation evaluations were recorded"
    elif [e.step for e in evals] != sorted({e.step for e in evals}) or evals[-1].step != run.steps_run:
        problem = f"the validation steps {[e.step for e in evals]} do not end at the last step run"
    elif (first := _first_stop(regressions(evals, parent), patience)) is None:
        problem = f"the recorded validation did not regress {patience} evaluation(s) in a row"
    elif first < len(evals) - 1:
        problem = "the recorded validation called for a stop before the step where training stopped"
    not_started = (run.steps_planned - run.steps_run) * batch if batch is not None else 0
    return EarlyStop(not_started, why, problem)
