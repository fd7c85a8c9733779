"""The gate's verdict: check consistency, run the seven checks, void the stale ones, and decide `PROMOTE TO
BOUNDED CANARY` only when all seven pass and none is void, else `HOLD` (`UNATTESTED`: a receipt file whose
pipeline attestation does not verify). An inconsistency fails the check it touches whatever its body found;
when a blocking check stopped the graph, the checks lacking evidence name the stage that did not run and why.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal

from pydantic import BaseModel

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.consistency import CLOCK_SKEW_S, KnownActors, inconsistencies
from lightning_dagster.gate.evidence_checks import check_pinned, check_retry_debt, check_span_coverage
from lightning_dagster.gate.findings import CheckResult, Findings
from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt_models import GateRecord, Receipt, receipt_hash
from lightning_dagster.gate.release_checks import (
    check_canary_verified,
    check_heldout_margin,
    check_protected_cases,
    check_rollback_and_approval,
)
from lightning_dagster.gate.stage_table import NO_CAUSES, STAGES, Causes, ran, stop_causes
from lightning_dagster.gate.staleness import void_checks

PROMOTE = "PROMOTE TO BOUNDED CANARY"
HOLD = "HOLD"
UNATTESTED = "UNATTESTED"

_BODIES: dict[Check, Callable[[Receipt, Policy, Causes], CheckResult]] = {
    Check.pinned: check_pinned,
    Check.span_coverage: check_span_coverage,
    Check.retry_debt: check_retry_debt,
    Check.heldout_margin: check_heldout_margin,
    Check.protected_cases: check_protected_cases,
    Check.canary_verified: check_canary_verified,
    Check.rollback_and_approval: check_rollback_and_approval,
}


def run_check(
    check: Check | int,
    receipt: Receipt,
    policy: Policy,
    *,
    roles: KnownActors | None = None,
    now: float | None = None,
    clock_skew_s: float = CLOCK_SKEW_S,
    earlier: Collection[str] = (),
) -> CheckResult:
    """One check on a receipt under a policy (staleness aside), after the consistency validation."""
    check = Check(check)
    found = inconsistencies(receipt, roles=roles, now=now, clock_skew_s=clock_skew_s, earlier=earlier)
    if all(ran(receipt, stage.name) for stage in STAGES):  # nothing stopped: no other check to judge
        return _judged(check, receipt, policy, found[check])
    return _judged_all(receipt, policy, found)[0][check]


def _judged_all(
    receipt: Receipt, policy: Policy, found: dict[Check, Findings]
) -> tuple[dict[Check, CheckResult], dict[str, str]]:
    """All seven checks (naming why the stages that did not run did not), and those causes."""
    results = {check: _judged(check, receipt, policy, found[check]) for check in Check}
    causes = stop_causes(receipt, {check: r.status for check, r in results.items()})
    if causes:
        results = {check: _judged(check, receipt, policy, found[check], causes) for check in Check}
    return results, causes


def _judged(
    check: Check, receipt: Receipt, policy: Policy, found: Findings, causes: Causes = NO_CAUSES
) -> CheckResult:
    """The check's own verdict, overruled by the inconsistencies found in the evidence it reads."""
    result = _BODIES[check](receipt, policy, causes)
    if not found.fails and not found.missing:
        return result
    figures = {**result.figures, "inconsistent": found.fails, "unverifiable": found.missing}
    if found.fails:
        reason = "inconsistent evidence: " + "; ".join(found.fails)
        also = [result.reason] if result.status != "pass" else []
        also += [f"unavailable: {m}" for m in found.missing]
        if also:
            reason += f" (also {'; '.join(also)})"
        return result.model_copy(update={"status": "fail", "reason": reason, "figures": figures})
    if result.status == "pass":
        reason = "; ".join(found.missing)
        return result.model_copy(update={"status": "unavailable", "reason": reason, "figures": figures})
    return result.model_copy(
        update={"reason": f"{result.reason}; {'; '.join(found.missing)}", "figures": figures}
    )


class Evaluation(BaseModel):
    # UNATTESTED: judged on a receipt file whose pipeline attestation does not verify (`unattested`)
    verdict: Literal["PROMOTE TO BOUNDED CANARY", "HOLD", "UNATTESTED"]
    checks: list[CheckResult]
    policy_version: str
    policy_hash: str
    receipt_id: str
    receipt_hash: str
    stale_checks: list[Check]
    hold_reasons: list[str]
    # stage -> why it did not run (a blocking check upstream did not pass); empty when nothing was stopped
    not_run: dict[str, str] = {}

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def unattested(self, why: str) -> Evaluation:
        """This evaluation of evidence the pipeline did not attest: never a promotion, whatever the checks."""
        reasons = [f"{UNATTESTED}: {why}", *self.hold_reasons]
        return self.model_copy(update={"verdict": UNATTESTED, "hold_reasons": reasons})

    def to_record(self) -> GateRecord:
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
    receipt: Receipt,
    policy: Policy,
    current_fingerprints: Mapping[str, str | None] | None = None,
    *,
    roles: KnownActors | None = None,
    now: float | None = None,
    clock_skew_s: float = CLOCK_SKEW_S,
    earlier: Collection[str] = (),
) -> Evaluation:
    """The verdict; `earlier`: evidence hashes of the receipt's earlier versions (for canary approvals)."""
    found = inconsistencies(receipt, roles=roles, now=now, clock_skew_s=clock_skew_s, earlier=earlier)
    judged, causes = _judged_all(receipt, policy, found)
    checks = list(judged.values())
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
        not_run=causes,
    )
