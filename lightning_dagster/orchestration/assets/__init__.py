"""The snapshot-partitioned asset graph: each asset calls one `pipeline.stages` function for its metadata
(big artifacts are written by the stage and referenced by URI, never pickled through an IO manager)."""

import warnings
from typing import Any

import dagster as dg
from dagster._utils.warnings import PreviewWarning
from pydantic import Field

from lightning_dagster.orchestration.assets.failures import snapshot_stage
from lightning_dagster.orchestration.assets.metadata import materialized
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.pipes_child import decode, pipes_settings
from lightning_dagster.orchestration.resources import PipelineResource
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.report import receipt_guide
from lightning_dagster.pipeline.stages import evaluation, release, snapshot, training
from lightning_dagster.pipeline.stages import rollouts as rollout_stages
from lightning_dagster.pipeline.versions import code_version
from lightning_dagster.settings import NonEmpty
from lightning_dagster.training.distributed import command

TRAINER_POOL = "trainer"


def snapshot_asset(group: str, kinds: set[str], *packages: str, **kwargs: Any) -> Any:
    """`dg.asset` of the snapshot-partitioned graph, its code version that of `packages`."""
    return dg.asset(
        partitions_def=snapshots,
        group_name=group,
        kinds=kinds,
        code_version=code_version(*packages),
        **kwargs,
    )


class SnapshotCut(dg.Config):
    """What the sensor or schedule that cut the snapshot decided (empty for a partition added by hand: the
    key's own seed draws its tasks); read only by the run that first freezes the snapshot."""

    train_seed: int | None = Field(default=None, description="The train seed of the cut")
    serve_rollout_ids: list[NonEmpty] = Field(default=[], description="The serve rollouts the snapshot holds")


@snapshot_asset("snapshot", {"python"}, "harnesses")
def tasks(
    context: dg.AssetExecutionContext, config: SnapshotCut, pipeline: PipelineResource
) -> dg.MaterializeResult:
    """The snapshot's train / holdout / protected / canary task sets, frozen by content hash."""
    cut = config.model_dump() if config.train_seed is not None else None
    with snapshot_stage("tasks", context.partition_key) as key:
        return materialized(snapshot.tasks(pipeline, key, cut))


@snapshot_asset("snapshot", {"python"}, "gate", deps=[tasks])
def update_plan(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Receipt phase 1: candidate id, exact parent, snapshots, evaluator, algorithm, scope, approvers, expected
    span families and retry budget, frozen before any rollout runs (`cannot_pass`: why it cannot pass)."""
    with snapshot_stage("update_plan", context.partition_key) as key:
        result = snapshot.update_plan(pipeline, key)
    if not result.metadata["plan_can_pass"]:
        context.log.warning(f"this plan cannot pass policy {result.metadata['policy']}: see `cannot_pass`")
    return materialized(result)


@snapshot_asset("rollouts", {"openai"}, "runner", "gateway", deps=[update_plan])
def rollouts(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The harness run on every train task x group size through the gateway serving the exact parent."""
    with snapshot_stage("rollouts", context.partition_key) as key:
        return materialized(rollout_stages.rollouts(pipeline, key))


@snapshot_asset("rollouts", {"sqlalchemy"}, "gate", deps=[rollouts])
def spans(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """LLM, tool and reward spans of the snapshot's rollouts, with coverage against the expected families."""
    with snapshot_stage("spans", context.partition_key) as key:
        return materialized(rollout_stages.spans(pipeline, key))


@snapshot_asset("training", {"pytorch"}, "training", deps=[spans])
def training_transitions(
    context: dg.AssetExecutionContext, pipeline: PipelineResource
) -> dg.MaterializeResult:
    """Merged token rows with loss masks, behaviour logprobs and rollout-level advantages, stored as a file."""
    with snapshot_stage("training_transitions", context.partition_key) as key:
        return materialized(training.training_transitions(pipeline, key))


@snapshot_asset(
    "training",
    {"pytorch", "mlflow"},
    "training",
    "registry",
    deps=[training_transitions],
    pool=TRAINER_POOL,
)
def candidate_resource(
    context: dg.AssetExecutionContext,
    pipeline: PipelineResource,
    trainer_pipes: dg.ResourceParam[dg.PipesClient],
) -> dg.MaterializeResult:
    """The parent updated by the trainer: checkpoint, MLflow model version with lineage, `latest-candidate`.
    The training runs in its own process (`nproc` ranks) launched through Dagster Pipes (`trainer_pipes`)."""
    t = ctx.settings(pipeline).training
    with snapshot_stage("candidate_resource", context.partition_key) as key:
        training.inputs_ready(pipeline, key)  # named here, before a trainer process starts
    return through_pipes(
        context,
        trainer_pipes,
        command(t.nproc, "lightning_dagster.orchestration.pipes_child", t.device),
        {"pipeline": pipes_settings(pipeline), "partition_key": key, "run_id": context.run.run_id},
    )


def through_pipes(
    context: dg.AssetExecutionContext, client: dg.PipesClient, command: list[str], extras: dict
) -> dg.MaterializeResult:
    """Run a stage in a process launched by a Pipes client; its result becomes the asset's metadata."""
    with warnings.catch_warnings():
        # Dagster's own subprocess client calls a Pipes API it marks as preview; not ours to act on
        warnings.simplefilter("ignore", PreviewWarning)
        invocation = client.run(context=context, command=command, extras=extras)
    (message,) = invocation.get_custom_messages()
    return materialized(decode(message))


@snapshot_asset("evaluation", {"pytorch"}, "gate", "runner", deps=[candidate_resource])
def holdout_evaluation(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Candidate against its exact parent on the closed held-out set and the protected cases, same seeds."""
    with snapshot_stage("holdout_evaluation", context.partition_key) as key:
        return materialized(evaluation.holdout_evaluation(pipeline, key))


@snapshot_asset("evaluation", {"openai"}, "gate", "runner", deps=[holdout_evaluation])
def canary_results(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The bounded canary under its limits, each outcome verified at its destination."""
    with snapshot_stage("canary_results", context.partition_key) as key:
        return materialized(evaluation.canary_results(pipeline, key))


@snapshot_asset("evaluation", {"mlflow"}, "registry", deps=[canary_results])
def rollback_drill(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The exact parent loaded and served in a separate gateway, routing returned to it, its bytes verified."""
    with snapshot_stage("rollback_drill", context.partition_key) as key:
        return materialized(release.rollback_drill(pipeline, key))


@snapshot_asset(
    "release",
    {"mlflow"},
    "gate",
    "release",
    deps=[
        update_plan,
        rollouts,
        spans,
        candidate_resource,
        holdout_evaluation,
        canary_results,
        rollback_drill,
    ],
)
def release_receipt(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Receipt phases 2 and 3 and the verdict under the versioned policy. Re-judges all seven checks itself,
    so a run that selects only this asset bypasses nothing. Its metadata names the model judged and gives
    the run config of the approve / promote / rollback jobs."""
    with snapshot_stage("release_receipt", context.partition_key) as key:
        keys = list(context.instance.get_dynamic_partitions(snapshots.name))
        result = release.release_receipt(pipeline, key, run_id=context.run.run_id, keys=keys)
        result.metadata.update(receipt_guide(pipeline, key))
    return materialized(result)


snapshot_assets = [
    tasks,
    update_plan,
    rollouts,
    spans,
    training_transitions,
    candidate_resource,
    holdout_evaluation,
    canary_results,
    rollback_drill,
    release_receipt,
]
