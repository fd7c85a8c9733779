"""The code location: `dagster dev -w workspace.yaml` loads `defs` from this module."""

from __future__ import annotations

import dagster as dg

from lightning_dagster.orchestration.assets import snapshot_assets
from lightning_dagster.orchestration.assets.gate_checks import GATE_CHECKS
from lightning_dagster.orchestration.jobs import (
    approve,
    continual_learning,
    promote,
    restore_approved_alias,
    resume,
    rollback,
)
from lightning_dagster.orchestration.resources import default_pipeline
from lightning_dagster.orchestration.sensors import (
    approved_alias_sensor,
    continual_learning_sensor,
    nightly_snapshot,
    stale_evidence_sensor,
)


def build_definitions(
    *, deferred: bool = True, **resource_overrides: dg.ConfigurableResource
) -> dg.Definitions:
    """The whole code location; tests pass smaller settings (`training=TrainingResource(steps=1)`).
    `deferred=False` reads environment variables now (for runs launched from Python, not from the UI)."""
    return dg.Definitions(
        assets=snapshot_assets,
        asset_checks=GATE_CHECKS,
        jobs=[continual_learning, approve, promote, rollback, resume, restore_approved_alias],
        # One process per run, its steps in order: the graph is a chain over one model, so the multiprocess
        # executor's parallel steps buy nothing here, while each of its ~17 step processes (assets and their
        # checks) imports torch, transformers and the pipeline again. Training still runs in its own process
        # (`trainer_pipes`); a deployment on a cluster sets its own executor here (e.g. dagster_k8s's).
        executor=dg.in_process_executor,
        sensors=[continual_learning_sensor, stale_evidence_sensor, approved_alias_sensor],
        schedules=[nightly_snapshot],
        resources={
            "pipeline": default_pipeline(deferred=deferred, **resource_overrides),
            # where candidate_resource's training runs; a cluster swaps in dagster_k8s.PipesK8sClient (README)
            "trainer_pipes": dg.ResourceDefinition.hardcoded_resource(
                dg.PipesSubprocessClient(),
                "Where candidate_resource's training process runs (Dagster Pipes): a local subprocess here; "
                "swap in dagster_k8s.PipesK8sClient for a cluster (README, Scaling out)",
            ),
        },
    )


defs = build_definitions()
