"""The gate's verdict: run the seven checks, void the stale ones, and decide.

The verdict is `PROMOTE TO BOUNDED CANARY` only when all seven pass and none is void by staleness;
otherwise `HOLD`, naming every check that did not pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.evidence_checks import check_pinned, check_retry_debt, check_span_coverage
from lightning_dagster.gate.findings import CheckResult
from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt_models import GateRecord, Receipt, receipt_hash
from lightning_dagster.gate.release_checks import (
    check_canary_verified,
    check_heldout_margin,
    check_protected_cases,
    check_rollback_and_approval,
)
from lightning_dagster.gate.staleness import void_checks

PROMOTE = "PROMOTE TO BOUNDED CANARY"
HOLD = "HOLD"

_BODIES: dict[Check, Callable[[Receipt, Policy], CheckResult]] = {
    Check.pinned: check_pinned,
    Check.span_coverage: check_span_coverage,
    Check.retry_debt: check_retry_debt,
    Check.heldout_margin: check_heldout_margin,
    Check.protected_cases: check_protected_cases,
    Check.canary_verified: check_canary_verified,
    Check.rollback_and_approval: check_rollback_and_approval,
}


def run_check(check: Check | int, receipt: Receipt, policy: Policy) -> CheckResult:
    """One check on a receipt under a policy (staleness aside); an unknown number raises `ValueError`."""
    return _BODIES[Check(check)](receipt, policy)


class Evaluation(BaseModel):
    verdict: Literal["PROMOTE TO BOUNDED CANARY", "HOLD"]
    checks: list[CheckResult]
    policy_version: str
    policy_hash: str
    receipt_id: str
    receipt_hash: str
    stale_checks: list[Check]
    hold_reasons: list[str]

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_record(self) -> GateRecord:
        """What the receipt keeps of this evaluation (see `receipt.with_gate_record`)."""
        return GateRecord(
            verdict=self.verdict,
            policy_version=self.policy_version,
            policy_hash=self.policy_hash,
            receipt_hash=self.receipt_hash,
            failed_checks=[c.id for c in self.checks if c.status == "fail"],
            unavailable_checks=[c.id for c in self.checks if c.status == "unavailable"],
            stale_checks=self.stale_checks,
        )


def evaluate(
    receipt: Receipt, policy: Policy, current_fingerprints: Mapping[str, str | None] | None = None
) -> Evaluation:
    """Run the seven checks, void the ones staleness affects, and decide the verdict."""
    checks = [run_check(check, receipt, policy) for check in Check]
    void = void_checks(
        receipt.fingerprints, current_fingerprints, required=policy.staleness.required_fingerprints
    )
    hold: list[str] = []
    for c in checks:
        c.void = void.get(c.id, [])
        if c.status != "pass":
            hold.append(f"check {c.id} ({c.title}) {c.status}: {c.reason}")
        if c.void:
            hold.append(f"check {c.id} ({c.title}) void: {'; '.join(c.void)}")
    verdict = PROMOTE if not hold else HOLD
    return Evaluation(
        verdict=verdict,
        checks=checks,
        policy_version=policy.version,
        policy_hash=policy.hash,
        receipt_id=receipt.receipt_id,
        receipt_hash=receipt_hash(receipt),
        stale_checks=sorted(void),
        hold_reasons=hold,
    )
