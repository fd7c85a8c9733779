"""The seven gate checks as blocking asset checks (ERROR severity: a failing check stops every downstream
asset in the same run), each on the asset whose evidence it judges; the judgement is the gate's.
"""

import warnings

import dagster as dg

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.orchestration.assets import (
    canary_results,
    candidate_resource,
    holdout_evaluation,
    rollback_drill,
    rollouts,
    spans,
)
from lightning_dagster.orchestration.assets.failures import snapshot_stage
from lightning_dagster.orchestration.assets.metadata import check_result
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import PipelineResource
from lightning_dagster.pipeline.stages import release

# The asset whose materialization brings the evidence each check judges.
JUDGED_ASSET: dict[Check, dg.AssetsDefinition] = {
    Check.pinned: candidate_resource,
    Check.span_coverage: spans,
    Check.retry_debt: rollouts,
    Check.heldout_margin: holdout_evaluation,
    Check.protected_cases: holdout_evaluation,
    Check.canary_verified: canary_results,
    Check.rollback_and_approval: rollback_drill,
}


def check_description(check: Check) -> str:
    """The gate's description, plus what this asset check judges when it is less than the receipt does."""
    if check in release.FIRST_BATCH_CHECKS:
        return (
            f"{check.description} Judged here on the first batch only (the train rollouts sampled from the "
            "parent); release_receipt judges it again over every rollout of the snapshot against the full plan."
        )
    return check.description


def gate_check(check: Check) -> dg.AssetChecksDefinition:
    """One blocking check: the same body serves all seven, only the check and its asset differ."""

    # Partitioned checks are a preview feature in 1.13; they are what lets each check judge its partition.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)

        @dg.asset_check(
            asset=JUDGED_ASSET[check],
            name=check.name,
            description=check_description(check),
            blocking=True,
            partitions_def=snapshots,
        )
        def _check(context: dg.AssetCheckExecutionContext, pipeline: PipelineResource) -> dg.AssetCheckResult:
            with snapshot_stage(f"check {check.name}", context.partition_key) as key:
                return check_result(release.judge(pipeline, key, check))

    return _check


GATE_CHECKS: list[dg.AssetChecksDefinition] = [gate_check(check) for check in Check]
