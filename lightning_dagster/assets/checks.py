"""The seven gate checks as blocking asset checks, each on the asset whose evidence it judges.

ERROR severity and `blocking=True`: a failing check stops every downstream asset in the same run. The
judgement itself is the gate's (`lightning_dagster.gate`), reached through `pipeline.stages.release.judge`.
"""

import warnings

import dagster as dg

from lightning_dagster.assets import (
    canary_results,
    candidate_resource,
    holdout_evaluation,
    rollback_drill,
    rollouts,
    spans,
)
from lightning_dagster.assets.metadata import check_result
from lightning_dagster.partitions import snapshots
from lightning_dagster.pipeline.stages import release
from lightning_dagster.resources import PipelineResource


def gate_check(
    check_id: int, name: str, asset: dg.AssetsDefinition, description: str
) -> dg.AssetChecksDefinition:
    """One blocking check: the same body serves all seven, only the check id and its asset differ."""

    # Partitioned checks are a preview feature in 1.13; they are what lets each check judge its partition.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dg.PreviewWarning)

        @dg.asset_check(
            asset=asset, name=name, description=description, blocking=True, partitions_def=snapshots
        )
        def _check(context: dg.AssetCheckExecutionContext, pipeline: PipelineResource) -> dg.AssetCheckResult:
            return check_result(release.judge(pipeline, context.partition_key, check_id))

    return _check


GATE_CHECKS: list[dg.AssetChecksDefinition] = [
    gate_check(
        1,
        "pinned",
        candidate_resource,
        "Resource, exact parent (resolvable, loadable), data snapshot and evaluator are pinned.",
    ),
    gate_check(
        2, "span_coverage", spans, "Every finished rollout has complete coverage of its expected spans."
    ),
    gate_check(
        3,
        "retry_debt",
        rollouts,
        "Unexpected retry debt is zero (sample and infrastructure retries told apart).",
    ),
    gate_check(
        4,
        "heldout_margin",
        holdout_evaluation,
        "The candidate beats its exact parent on the closed held-out set.",
    ),
    gate_check(
        5,
        "protected_cases",
        holdout_evaluation,
        "No protected-case regressions beyond the per-family tolerance.",
    ),
    gate_check(
        6,
        "canary_verified",
        canary_results,
        "Every bounded canary task has a verified outcome and no harmful effect.",
    ),
    gate_check(
        7,
        "rollback_and_approval",
        rollback_drill,
        "Rollback resolves and was tested; an authorized actor approved the step.",
    ),
]
