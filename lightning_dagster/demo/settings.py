"""The demo's training settings: one value for the full demo, one for the `--quick` smoke run."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dagster.resources import TrainingResource

# Two whole cycles (warm start, 2 x RL + evaluation + canary + drill) within 10 minutes on 2 cores: 8 RL steps
# of 8 tasks x 16 rollouts at lr 1e-4 per cycle; 128 held-out tasks clear the default policy's min_n (100).
DEMO_TRAINING: dict[str, int | float] = dict(
    steps=8,
    tasks_per_step=8,
    group_size=16,
    learning_rate=1e-4,
    holdout_tasks=128,
    protected_tasks=32,
    canary_tasks=8,
)
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


def demo_training(steps: int | None, quick: bool) -> TrainingResource:
    """`DEMO_TRAINING` (or `QUICK_TRAINING`), with `steps` RL steps when given."""
    from lightning_dagster.resources import TrainingResource

    settings = QUICK_TRAINING if quick else DEMO_TRAINING
    return TrainingResource(**{**settings, "steps": steps or settings["steps"]})
