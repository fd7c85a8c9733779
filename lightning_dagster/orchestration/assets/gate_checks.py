"""The seven gate checks as blocking asset checks (ERROR severity: a failure stops every downstream asset of
the run), each on the asset whose evidence it judges."""

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

JUDGED_ASSET: dict[Check, dg.AssetsDefinition] = {  # the asset bringing the evidence each check judges
    Check.pinned: candidate_resource,
    Check.span_coverage: spans,
    Check.retry_debt: rollouts,
    Check.heldout_margin: holdout_evaluation,
    Check.protected_cases: holdout_evaluation,
    Check.canary_verified: canary_results,
    Check.rollback_and_approval: rollback_drill,
}


def gate_check(check: Check) -> dg.AssetChecksDefinition:
    """One blocking check; partitioned checks are a preview feature in Dagster 1.13."""
    description = check.description
    if check in release.FIRST_BATCH_CHECKS:  # judged here on less than the receipt judges
        description += (
            " Judged here on the first batch only (the train rollouts sampled from the parent); "
            "release_receipt judges it again over every rollout of the snapshot against the full plan."
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)

        @dg.asset_check(
            asset=JUDGED_ASSET[check],
            name=check.name,
            description=description,
            blocking=True,
            partitions_def=snapshots,
        )
        def _check(context: dg.AssetCheckExecutionContext, pipeline: PipelineResource) -> dg.AssetCheckResult:
            with snapshot_stage(f"check {check.name}", context.partition_key) as key:
                return check_result(release.judge(pipeline, key, check))

    return _check


GATE_CHECKS: list[dg.AssetChecksDefinition] = [gate_check(check) for check in Check]
