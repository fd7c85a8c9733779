"""A check's result, and how a check body collects failures and missing evidence: a definite failure outranks
missing evidence; missing evidence is never a pass.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, computed_field

from lightning_dagster.gate.check_ids import Check

Status = Literal["pass", "fail", "unavailable"]


class CheckResult(BaseModel):
    id: Check
    status: Status
    reason: str
    figures: dict[str, Any]
    void: list[str] = []  # staleness reasons; a void check cannot count as passed

    @computed_field
    @property
    def name(self) -> str:
        """The check's machine name (`heldout_margin`), as the asset checks and policy attributes use it."""
        return self.id.name

    @computed_field
    @property
    def title(self) -> str:
        return self.id.title


class Findings:
    """Collects definite failures and missing evidence; the status follows from which lists are empty."""

    def __init__(self) -> None:
        self.fails: list[str] = []
        self.missing: list[str] = []

    def fail(self, why: str) -> None:
        self.fails.append(why)

    def miss(self, why: str) -> None:
        self.missing.append(why)

    def tri(self, value: bool | None, what: str, fail_text: str, missing_text: str) -> None:
        """An observation that may be true, false (a failure) or never made (missing evidence)."""
        if value is False:
            self.fail(f"{what} {fail_text}")
        elif value is None:
            self.miss(f"{what} {missing_text}")

    def result(self, check: Check, ok_reason: str, figures: dict[str, Any]) -> CheckResult:
        if self.fails:
            status: Status = "fail"
            reason = "; ".join(self.fails)
            if self.missing:
                reason += f" (also unavailable: {'; '.join(self.missing)})"
        elif self.missing:
            status, reason = "unavailable", "; ".join(self.missing)
        else:
            status, reason = "pass", ok_reason
        return CheckResult(id=check, status=status, reason=reason, figures=figures)


def rounded(x: float | None) -> float | None:
    """Figures are rounded to 6 places so reports do not show float noise."""
    return None if x is None else round(x, 6)
