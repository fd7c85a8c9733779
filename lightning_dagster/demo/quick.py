"""The demo's training settings: the code location's defaults for the full demo, `QUICK_TRAINING` for the
`--quick` smoke run, judged under `QUICK_POLICY` (quick-v1), whose minimums these sizes meet."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dagster.orchestration.resources import TrainingResource

# Tiny settings: a smoke run of the whole flow, not a learning one (`--quick`, and the Dagster tests).
QUICK_TRAINING: dict[str, int | float] = dict(
    steps=2,
    tasks_per_step=4,
    group_size=4,
    holdout_tasks=8,
    protected_tasks=4,
    canary_tasks=2,
    warm_start_max_steps=4,
    warm_start_probe_tasks=8,
    warm_start_demos=64,
)
QUICK_POLICY = Path(__file__).parents[1] / "gate" / "policies" / "quick-v1.yaml"


def demo_training(steps: int | None, quick: bool, *, adapter: str | None = None) -> TrainingResource:
    """The code location's defaults (`TrainingResource()`: one evaluator fingerprint in the demo and the UI),
    or `QUICK_TRAINING`, with `steps` RL steps and the `adapter` when given."""
    from lightning_dagster.orchestration.resources import TrainingResource

    settings = QUICK_TRAINING if quick else {}
    given = {"steps": steps, "adapter": adapter}
    return TrainingResource(**settings, **{k: v for k, v in given.items() if v})
