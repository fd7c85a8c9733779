"""The seven checks of the release gate, named once (number, machine name, title, description)."""

from __future__ import annotations

from enum import IntEnum


class Check(IntEnum):
    """Value: the number receipts and policy files store; name: the asset check's and policy attribute's."""

    title: str
    description: str

    def __new__(cls, number: int, title: str, description: str) -> Check:
        member = int.__new__(cls, number)
        member._value_ = number
        member.title = title
        member.description = description
        return member

    pinned = (
        1,
        "pinned identity",
        "Resource, exact parent (resolvable, loadable), data snapshots and evaluator are pinned.",
    )
    span_coverage = (
        2,
        "span coverage",
        "Every finished rollout has complete coverage of its expected spans.",
    )
    retry_debt = (
        3,
        "retry debt",
        "Unexpected retry debt is zero (sample and infrastructure retries told apart).",
    )
    heldout_margin = (
        4,
        "held-out vs exact parent",
        "The candidate beats its exact parent on the closed held-out set.",
    )
    protected_cases = (5, "protected cases", "No protected-case regressions beyond the per-family tolerance.")
    canary_verified = (
        6,
        "bounded canary",
        "Every bounded canary task has a verified outcome and no harmful effect.",
    )
    rollback_and_approval = (
        7,
        "rollback and approval",
        "Rollback resolves and was tested; an authorized actor approved the step.",
    )

    @property
    def section(self) -> str:
        """The key of this check's thresholds in a policy file (`checks: {4: ...}`)."""
        return str(self.value)
