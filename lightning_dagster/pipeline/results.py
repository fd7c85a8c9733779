"""What a pipeline stage hands back to the orchestrator: plain values, no Dagster types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class Markdown:
    """A value the UI should render as Markdown (tables of per-family results, the verdict)."""

    text: str


@dataclass
class Link:
    """A value the UI should render as a link (the MLflow run, the model version)."""

    url: str


@dataclass
class Table:
    """A value the UI should render as a table: column names, and rows of plain JSON-able values."""

    columns: list[str]
    rows: list[list[Any]]


@dataclass
class StageResult:
    """One stage's outcome: the metadata a user looks at, and a data version when the output has an identity
    (a checkpoint hash, a receipt hash) so the lineage view can tell which inputs produced it."""

    metadata: dict[str, Any] = field(default_factory=dict)
    data_version: str | None = None


@dataclass
class CheckOutcome:
    """One gate check judged on the evidence available at a stage: `unavailable` is never a pass."""

    check_id: int
    name: str
    status: Literal["pass", "fail", "unavailable"]
    reason: str
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.status == "pass"
