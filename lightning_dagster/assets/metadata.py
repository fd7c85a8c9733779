"""Turn a pipeline stage's plain result into Dagster metadata and events."""

from __future__ import annotations

from typing import Any

import dagster as dg

from lightning_dagster.pipeline.results import CheckOutcome, Link, Markdown, StageResult


def metadata_value(value: Any) -> Any:
    if isinstance(value, Markdown):
        return dg.MetadataValue.md(value.text)
    if isinstance(value, Link):
        return dg.MetadataValue.url(value.url)
    if isinstance(value, dict | list):
        return dg.MetadataValue.json(value)
    if value is None:
        # Missing evidence is shown as unavailable, never as a healthy-looking zero.
        return dg.MetadataValue.text("unavailable")
    return value


def to_metadata(values: dict[str, Any]) -> dict[str, Any]:
    return {key: metadata_value(value) for key, value in values.items()}


def materialized(result: StageResult) -> dg.MaterializeResult:
    return dg.MaterializeResult(
        metadata=to_metadata(result.metadata),
        data_version=dg.DataVersion(result.data_version) if result.data_version else None,
    )


def check_result(outcome: CheckOutcome) -> dg.AssetCheckResult:
    """Every gate check is ERROR severity: combined with `blocking=True` a failure stops the run downstream."""
    return dg.AssetCheckResult(
        passed=outcome.passed,
        severity=dg.AssetCheckSeverity.ERROR,
        description=f"check {outcome.check_id} ({outcome.name}): {outcome.status}: {outcome.reason}",
        metadata=to_metadata(
            {
                "check_id": outcome.check_id,
                "status": outcome.status,
                "reason": outcome.reason,
                **outcome.figures,
            }
        ),
    )
