"""Stop conditions for continual learning, judged by the gate's own checks: pause when span coverage dropped,
retry debt crossed its limit, the protected set regressed, the parent became unavailable, or the canary could
not verify an external effect. Missing evidence does not pause by itself; it is listed in `unavailable`.
"""

from __future__ import annotations

from pydantic import BaseModel

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import run_check
from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt_models import Receipt


class StopDecision(BaseModel):
    pause: bool
    reasons: list[str]
    unavailable: list[str] = []


def stop_decision(latest: Receipt, policy: Policy, previous: Receipt | None = None) -> StopDecision:
    reasons: list[str] = []
    unavailable: list[str] = []

    coverage = run_check(Check.span_coverage, latest, policy)
    share = coverage.figures.get("complete_share")
    if share is None:
        unavailable.append(f"span coverage: {coverage.reason}")
    elif coverage.status == "fail":
        reasons.append(f"span coverage dropped: {coverage.reason}")
    elif previous is not None:
        before = run_check(Check.span_coverage, previous, policy).figures.get("complete_share")
        if before is not None and share < before - policy.stop.max_coverage_drop:
            reasons.append(f"span coverage dropped from {before} to {share}")

    for check, what, failed in (
        (Check.retry_debt, "retry debt", "over its limit"),
        (Check.protected_cases, "protected set", "regressed"),
    ):
        result = run_check(check, latest, policy)
        if result.status == "fail":
            reasons.append(f"{what} {failed}: {result.reason}")
        elif result.status == "unavailable":
            unavailable.append(f"{what}: {result.reason}")

    # The parent is the rollback target and the baseline: unknown availability is as bad as none.
    parent = latest.plan.parent
    drill = latest.rollback_drill
    if parent.resolves is not True or parent.loads is not True:
        reasons.append(
            f"parent {parent.resource_id} unavailable (resolves={parent.resolves}, loads={parent.loads})"
        )
    elif drill is not None and (drill.resolved is False or drill.loaded is False):
        reasons.append(f"parent {parent.resource_id} unavailable in the rollback drill")

    canary = run_check(Check.canary_verified, latest, policy)
    weaker = canary.figures.get("weaker_evidence") or []
    if weaker:
        ids = ", ".join(t["task_id"] for t in weaker[:10])
        reasons.append(f"canary could not verify an external effect for {len(weaker)} tasks: {ids}")
    elif canary.figures.get("tasks") is None or canary.figures.get("unverifiable"):
        unavailable.append(f"canary: {canary.reason}")

    return StopDecision(pause=bool(reasons), reasons=reasons, unavailable=unavailable)
