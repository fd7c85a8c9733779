"""The demo's training settings: the code location's defaults for the full demo, `QUICK_TRAINING` for the
`--quick` smoke run, judged under `QUICK_POLICY` (quick-v1), whose minimums these sizes meet."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dagster.orchestration.resources import TrainingResource

# Small settings that still show the whole flow: a parent that solves some tasks (else RL changes nothing
# and checks 4 to 7 never run), groups of 8 whose rewards differ, and closed sets `QUICK_POLICY` fits.
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
    """The code location's defaults (one fingerprint in demo and UI) or `QUICK_TRAINING`, under `given`."""
    from lightning_dagster.orchestration.resources import TrainingResource

    return TrainingResource(**{**(QUICK_TRAINING if quick else {}), **given})
