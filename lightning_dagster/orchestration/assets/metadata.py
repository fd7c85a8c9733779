"""Turn a pipeline stage's plain result into Dagster metadata and events."""

from __future__ import annotations

import json
from typing import Any

import dagster as dg

from lightning_dagster.pipeline.results import CheckOutcome, Link, Markdown, StageResult, Table

# Dagster's table column types for the scalar cells; any other value (a list, a dict) is shown as JSON text.
CELL_TYPES: dict[type, str] = {bool: "bool", int: "int", float: "float", str: "string"}


def _cell(value: Any) -> Any:
    return value if value is None or type(value) in CELL_TYPES else json.dumps(value, sort_keys=True)


def _column_type(values: list[Any]) -> str:
    types = {CELL_TYPES.get(type(v), "string") for v in values if v is not None}
    if types == {"int", "float"}:
        return "float"
    return types.pop() if len(types) == 1 else "string"


def table_value(table: Table) -> dg.TableMetadataValue:
    columns = [
        dg.TableColumn(name, _column_type([row[i] for row in table.rows]))
        for i, name in enumerate(table.columns)
    ]
    records = [
        dg.TableRecord({name: _cell(cell) for name, cell in zip(table.columns, row, strict=True)})
        for row in table.rows
    ]
    return dg.MetadataValue.table(records, schema=dg.TableSchema(columns=columns))


def metadata_value(value: Any) -> Any:
    if isinstance(value, Table):
        return table_value(value)
    if isinstance(value, Markdown):
        return dg.MetadataValue.md(value.text)
    if isinstance(value, Link):
        return dg.MetadataValue.url(value.url)
    if isinstance(value, dict | list):
        return dg.MetadataValue.json(value)
    if isinstance(value, bool):
        return dg.MetadataValue.bool(value)
    if isinstance(value, int):
        return dg.MetadataValue.int(value)
    if isinstance(value, float):
        return dg.MetadataValue.float(value)
    if value is None:
        # Missing evidence is shown as unavailable, never as a healthy-looking zero.
        return dg.MetadataValue.text("unavailable")
    return value


# Numbers that name something rather than measure it: text, so Dagster's Plots tab charts only measurements.
IDENTIFIERS = frozenset({"check_id", "receipt_version", "candidate_version", "parent_version"})


def to_metadata(values: dict[str, Any]) -> dict[str, Any]:
    return {
        key: dg.MetadataValue.text(str(value))
        if key in IDENTIFIERS and value is not None
        else metadata_value(value)
        for key, value in values.items()
    }


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
