"""Checkpoint selection on a validation split: which checkpoint a run proposes (the best one that keeps every
validation case the parent solved) and when a run stops because validation regressed. Pure logic, no I/O.

Rules, in order:
- a checkpoint *keeps the parent's cases* when it solves (greedily) every validation case the parent solved;
- among those, the highest validation success wins, ties going to the later checkpoint: its extra training
  is what lifts sampled success (the gate's held-out measure) once greedy success stops telling them apart;
- when none keeps them all (the fallback, recorded as such), the one losing fewest wins, then the higher
  success, then the earlier: when every choice does damage, the one closest to the parent does least;
- an evaluation *regresses* when it loses a parent-solved case or its success falls below the best
  success seen so far (the parent's included); `patience` regressions in a row stop the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dagster.project import TaskSet


class ValidationConfigError(ValueError):
    """A validation setting that cannot be used (negative size, interval or patience, bad threshold)."""


class EmptyValidationSplit(ValueError):
    """Validation was asked for, but no train task is left outside the run's own train tasks."""


@dataclass(frozen=True, kw_only=True)
class ValidationSettings:
    """Checkpoint selection as the user set it (`training.configs.validation_settings`)."""

    tasks: int  # 0: no validation, the last checkpoint is the candidate (and no early stop)
    every: int  # evaluate every `every` steps, and the last step
    patience: int  # evaluations in a row that regressed before training stops (0: never stop early)
    success_threshold: float  # a validation case is solved at or above this reward

    def __post_init__(self) -> None:
        if self.tasks < 0:
            raise ValidationConfigError(f"validation tasks must be >= 0, got {self.tasks}")
        if self.every < 1:
            raise ValidationConfigError(f"validation every must be >= 1 step, got {self.every}")
        if self.patience < 0:
            raise ValidationConfigError(f"validation patience must be >= 0, got {self.patience}")
        if not 0.0 < self.success_threshold <= 1.0:
            raise ValidationConfigError(f"success_threshold must be in (0, 1], got {self.success_threshold}")

    def due(self, step: int, last_step: int) -> bool:
        return self.tasks > 0 and (step % self.every == 0 or step == last_step)


def solved_cases(rewards: Mapping[str, float | None], threshold: float) -> frozenset[str]:
    """Task ids whose reward reaches `threshold` (a missing reward solved nothing)."""
    return frozenset(task for task, reward in rewards.items() if (reward or 0.0) >= threshold)


@dataclass(frozen=True)
class CheckpointEval:
    step: int
    success: float  # share of validation cases solved greedily
    lost: tuple[str, ...]  # validation cases the parent solved and this checkpoint does not, sorted

    def to_dict(self) -> dict:
        return {**asdict(self), "lost": list(self.lost), "lost_parent_cases": len(self.lost)}


def judge(step: int, solved: Iterable[str], parent_solved: Iterable[str], cases: int) -> CheckpointEval:
    """Checkpoint `step` on `cases` validation cases, of which it solved `solved`."""
    if cases < 1:
        raise ValidationConfigError("a checkpoint is judged on at least one validation case")
    mine = set(solved)
    return CheckpointEval(step, len(mine) / cases, tuple(sorted(set(parent_solved) - mine)))


@dataclass(frozen=True)
class Selection:
    step: int
    kept_parent_cases: bool  # False: no checkpoint kept them all, this is the fallback
    reason: str


def select(evals: Sequence[CheckpointEval]) -> Selection:
    """The checkpoint a run proposes among `evals` (see the module docstring)."""
    if not evals:
        raise ValueError("no checkpoint was evaluated on the validation split")
    keeping = [e for e in evals if not e.lost]
    if keeping:
        best = max(keeping, key=lambda e: (e.success, e.step))
        why = f"best validation success {best.success:.3f} keeping every parent-solved case"
        return Selection(best.step, True, why)
    best = min(evals, key=lambda e: (len(e.lost), -e.success, e.step))
    why = f"fallback: every checkpoint lost a parent-solved validation case; fewest lost ({len(best.lost)})"
    return Selection(best.step, False, why)


def regressions(evals: Sequence[CheckpointEval], parent_success: float) -> list[bool]:
    """For each evaluation in order: did it lose a parent-solved case or fall below the best success so far."""
    best, out = parent_success, []
    for e in evals:
        out.append(bool(e.lost) or e.success < best)
        best = max(best, e.success)
    return out


def stop_reason(evals: Sequence[CheckpointEval], parent_success: float, patience: int) -> str | None:
    """Why training stops after the last of `evals`, or None to go on."""
    if patience < 1 or len(evals) < patience or not all(regressions(evals, parent_success)[-patience:]):
        return None
    steps = ", ".join(str(e.step) for e in evals[-patience:])
    return f"validation regressed at {patience} evaluation(s) in a row (steps {steps})"


# -------------------------------------------------------------------------------------- the validation split


def reserved_validation(tasks: TaskSet, n: int, seed: int) -> frozenset[str]:
    """The train-split task ids held back for validation: the first `n` in `seed`'s order, but at most half
    the split, so a small project still trains on the rest."""
    rows = tasks.splits["train"]
    pool = tasks.draw("train", len(rows), seed)
    return frozenset(task["task_id"] for task in pool[: min(n, len(rows) // 2)])


def train_tasks(tasks: TaskSet, n: int, seed: int, *, validation: int, eval_seed: int) -> list[dict]:
    """The `n` train tasks a run trains on, never one `reserved_validation` holds back."""
    return tasks.draw("train", n, seed, exclude=reserved_validation(tasks, validation, eval_seed))


def validation_split(tasks: TaskSet, n: int, seed: int, trained: list[dict]) -> list[dict]:
    """Up to `n` tasks of the train split that the run does not train on, in `TaskSet.draw`'s seeded order."""
    taken = {task["task_id"] for task in trained}
    pool = tasks.draw("train", len(tasks.splits["train"]), seed)
    return [task for task in pool if task["task_id"] not in taken][:n]
