"""The snapshot-partitioned asset graph: one partition per data snapshot, one thin call per asset.

Every asset body is wiring: it calls one function of its group's module in `lightning_dagster.pipeline.stages`
(which calls the store, runner, trainer, gate and registry) and turns its result into metadata. Big artifacts (checkpoints,
transition files) are written by the stage and referenced by URI, never pickled through an IO manager.
"""

import warnings

import dagster as dg
from dagster._utils.warnings import PreviewWarning

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
from lightning_dagster.training.distributed import command

TRAINER_POOL = "trainer"


@dg.asset(
    partitions_def=snapshots,
    group_name="snapshot",
    kinds={"python"},
    code_version=code_version("harnesses"),
)
def tasks(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The snapshot's train / holdout / protected / canary task sets, frozen by content hash."""
    with snapshot_stage("tasks", context.partition_key) as key:
        return materialized(snapshot.tasks(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[tasks],
    group_name="snapshot",
    kinds={"python"},
    code_version=code_version("gate"),
)
def update_plan(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Receipt phase 1: candidate id, exact parent, snapshots, evaluator, algorithm, scope, approvers, expected
    span families and retry budget, frozen before any rollout runs. A plan that cannot pass its policy
    whatever the candidate does (too few held-out tasks for `min_n`, ...) says so in `cannot_pass`."""
    with snapshot_stage("update_plan", context.partition_key) as key:
        result = snapshot.update_plan(pipeline, key)
    if not result.metadata["plan_can_pass"]:
        context.log.warning(f"this plan cannot pass policy {result.metadata['policy']}: see `cannot_pass`")
    return materialized(result)


@dg.asset(
    partitions_def=snapshots,
    deps=[update_plan],
    group_name="rollouts",
    kinds={"openai"},
    code_version=code_version("runner", "gateway"),
)
def rollouts(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The harness run on every train task x group size through the gateway serving the exact parent; every
    attempt kept with its ending and reason."""
    with snapshot_stage("rollouts", context.partition_key) as key:
        return materialized(rollout_stages.rollouts(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[rollouts],
    group_name="rollouts",
    kinds={"sqlalchemy"},
    code_version=code_version("gate"),
)
def spans(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """LLM, tool and reward spans of the snapshot's rollouts, with coverage against the expected families."""
    with snapshot_stage("spans", context.partition_key) as key:
        return materialized(rollout_stages.spans(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[spans],
    group_name="training",
    kinds={"pytorch"},
    code_version=code_version("training"),
)
def training_transitions(
    context: dg.AssetExecutionContext, pipeline: PipelineResource
) -> dg.MaterializeResult:
    """Merged token rows with loss masks, behaviour logprobs and rollout-level advantages, stored as a file."""
    with snapshot_stage("training_transitions", context.partition_key) as key:
        return materialized(training.training_transitions(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[training_transitions],
    group_name="training",
    kinds={"pytorch", "mlflow"},
    code_version=code_version("training", "registry"),
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
    """Run a stage in a process launched by a Pipes client; its one reported stage result becomes the
    asset's metadata exactly as `materialized` makes it in process."""
    with warnings.catch_warnings():
        # Dagster's own subprocess client calls a Pipes API it marks as preview; not ours to act on
        warnings.simplefilter("ignore", PreviewWarning)
        invocation = client.run(context=context, command=command, extras=extras)
    (message,) = invocation.get_custom_messages()
    return materialized(decode(message))


@dg.asset(
    partitions_def=snapshots,
    deps=[candidate_resource],
    group_name="evaluation",
    kinds={"pytorch"},
    code_version=code_version("gate", "runner"),
)
def holdout_evaluation(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Candidate against its exact parent on the closed held-out set and the protected cases, same seeds."""
    with snapshot_stage("holdout_evaluation", context.partition_key) as key:
        return materialized(evaluation.holdout_evaluation(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[holdout_evaluation],
    group_name="evaluation",
    kinds={"openai"},
    code_version=code_version("gate", "runner"),
)
def canary_results(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The bounded canary under its limits, each outcome verified at its destination."""
    with snapshot_stage("canary_results", context.partition_key) as key:
        return materialized(evaluation.canary_results(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[canary_results],
    group_name="evaluation",
    kinds={"mlflow"},
    code_version=code_version("registry"),
)
def rollback_drill(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """The exact parent loaded and served in a separate gateway, routing returned to it, its bytes verified."""
    with snapshot_stage("rollback_drill", context.partition_key) as key:
        return materialized(release.rollback_drill(pipeline, key))


@dg.asset(
    partitions_def=snapshots,
    deps=[
        update_plan,
        rollouts,
        spans,
        candidate_resource,
        holdout_evaluation,
        canary_results,
        rollback_drill,
    ],
    group_name="release",
    kinds={"mlflow"},
    code_version=code_version("gate", "release"),
)
def release_receipt(context: dg.AssetExecutionContext, pipeline: PipelineResource) -> dg.MaterializeResult:
    """Receipt phases 2 and 3 and the verdict under the versioned policy. Re-judges all seven checks itself,
    so a run that selects only this asset bypasses nothing. Its metadata names the model judged (candidate
    and parent versions, snapshot, evaluator, receipt version), links to MLflow, and gives the run config of
    the approve / promote / rollback jobs with the actors and rollback targets they take."""
    with snapshot_stage("release_receipt", context.partition_key) as key:
        result = release.release_receipt(pipeline, key, run_id=context.run.run_id)
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
