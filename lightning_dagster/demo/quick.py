"""The demo's training settings: the code location's defaults for the full demo, `QUICK_TRAINING` for the
`--quick` smoke run, judged under `QUICK_POLICY` (quick-v1), whose minimums these sizes meet."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dagster.orchestration.resources import TrainingResource

# Small settings that still show the whole flow (`--quick`; the Dagster tests start from them): a warm start
# long enough that the parent solves some tasks (a parent that solves none gives every group the same reward:
# RL then changes no weight and check 1 holds the candidate, so checks 4 to 7 never run), groups of 8 so a
# step nearly always has a group whose rewards differ, and closed sets that `QUICK_POLICY`'s minimums fit.
QUICK_TRAINING: dict[str, int | float] = dict(
    steps=2,
    tasks_per_step=4,
    group_size=8,
    holdout_tasks=8,
    protected_tasks=4,
    canary_tasks=2,
    warm_start_max_steps=120,
    warm_start_probe_tasks=16,
    warm_start_demos=1000,
)
QUICK_POLICY = Path(__file__).parents[1] / "gate" / "policies" / "quick-v1.yaml"


def demo_training(quick: bool, **given: object) -> TrainingResource:
    """The code location's defaults (`TrainingResource()`: one evaluator fingerprint in the demo and the UI),
    or `QUICK_TRAINING`, with the settings the command line `given` (`--seed`, `--steps`, `--adapter`)."""
    from lightning_dagster.orchestration.resources import TrainingResource

    return TrainingResource(**{**(QUICK_TRAINING if quick else {}), **given})
