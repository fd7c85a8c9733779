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

# The assets whose materializations keep MLflow page paths (`mlflow_run_path`, `mlflow_model_version_path`).
MLFLOW_PAGES = ("candidate_resource", "release_receipt")


def with_mlflow_ui(assets: list[dg.AssetsDefinition], ui: str) -> list[dg.AssetsDefinition]:
    """`assets`, MLFLOW_PAGES with the MLflow UI's address (`mlflow_ui`), set at each load."""
    if not ui:
        return assets
    meta = {"mlflow_ui": dg.MetadataValue.url(ui)}
    return [
        a.map_asset_specs(lambda spec: spec.merge_attributes(metadata=meta))
        if a.key.to_user_string() in MLFLOW_PAGES
        else a
        for a in assets
    ]


def build_definitions(
    *, deferred: bool = True, **resource_overrides: dg.ConfigurableResource
) -> dg.Definitions:
    """The whole code location; `deferred=False` reads environment variables now."""
    from lightning_dagster.registry import links

    pipeline = default_pipeline(deferred=deferred, **resource_overrides)
    given = pipeline.mlflow.ui_url
    ui = given.rstrip("/") if given and not isinstance(given, dg.EnvVar) else links.current_ui()
    return dg.Definitions(
        assets=with_mlflow_ui(snapshot_assets, ui),
        asset_checks=GATE_CHECKS,
        jobs=[continual_learning, approve, promote, rollback, resume, restore_approved_alias],
        # One process per run: the graph is a chain, so parallel steps buy nothing, while each of ~17 step
        # processes would import torch, transformers and the pipeline again (training: `trainer_pipes`).
        executor=dg.in_process_executor,
        sensors=[continual_learning_sensor, stale_evidence_sensor, approved_alias_sensor],
        schedules=[nightly_snapshot],
        resources={
            "pipeline": pipeline,
            "trainer_pipes": dg.ResourceDefinition.hardcoded_resource(
                dg.PipesSubprocessClient(),
                "Where candidate_resource's training process runs (Dagster Pipes): a local subprocess here; "
                "swap in dagster_k8s.PipesK8sClient for a cluster (README, Scaling out)",
            ),
        },
    )


defs = build_definitions()
