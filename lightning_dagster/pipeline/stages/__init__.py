"""One function per asset, grouped by asset group: the calls into store, runner, trainer, gate and registry
that each asset makes.

Stages hand results to each other through the store, never through Dagster's IO managers, so the same
functions run under `dg.materialize`, `dagster dev`, the demo and the benchmark. Heavy imports (torch,
MLflow) happen inside the functions: loading the code location stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from types import ModuleType


@dataclass(frozen=True)
class Stage:
    """One asset's stage: its function `name` in the module of its asset group."""

    name: str
    group: str

    @property
    def module(self) -> ModuleType:
        return import_module(f"{__name__}.{self.group}")


# The graph's stages in materialization order (assets/ wires them; the orchestration benchmark calls them
# directly in this order).
ASSET_STAGES = (
    Stage("tasks", "snapshot"),
    Stage("update_plan", "snapshot"),
    Stage("rollouts", "rollouts"),
    Stage("spans", "rollouts"),
    Stage("training_transitions", "training"),
    Stage("candidate_resource", "training"),
    Stage("holdout_evaluation", "evaluation"),
    Stage("canary_results", "evaluation"),
    Stage("rollback_drill", "release"),
    Stage("release_receipt", "release"),
)
