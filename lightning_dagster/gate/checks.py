"""The seven checks of the release gate and the verdict.

Each check reads the receipt and the policy and returns `pass`, `fail` or `unavailable` with a reason and
its figures. A definite failure outranks missing evidence; missing evidence is never a pass. The verdict is
`PROMOTE TO BOUNDED CANARY` only when all seven pass and none is void by staleness; otherwise `HOLD`, naming
every check that did not pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Literal

from pydantic import BaseModel

from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt import GateRecord, Receipt, receipt_hash
from lightning_dagster.gate.staleness import void_checks
from lightning_dagster.types import AttemptState, RetryKind, RolloutKind, RolloutStatus

PROMOTE = "PROMOTE TO BOUNDED CANARY"
HOLD = "HOLD"
Status = Literal["pass", "fail", "unavailable"]

# Identifiers that name a moving target rather than an exact version.
UNPINNED = frozenset({"", "latest", "head", "main", "master", "current", "*"})


class CheckResult(BaseModel):
    id: int
    name: str
    status: Status
    reason: str
    figures: dict[str, Any]
    void: list[str] = []  # staleness reasons; a void check cannot count as passed


class Evaluation(BaseModel):
    verdict: Literal["PROMOTE TO BOUNDED CANARY", "HOLD"]
    checks: list[CheckResult]
    policy_version: str
    policy_hash: str
    receipt_id: str
    receipt_hash: str
    stale_checks: list[int]
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


class _Findings:
    """Collects definite failures and missing evidence; the status follows from which lists are empty."""

    def __init__(self) -> None:
        self.fails: list[str] = []
        self.missing: list[str] = []

    def fail(self, why: str) -> None:
        self.fails.append(why)

    def miss(self, why: str) -> None:
        self.missing.append(why)

    def result(self, check_id: int, ok_reason: str, figures: dict[str, Any]) -> CheckResult:
        if self.fails:
            status: Status = "fail"
            reason = "; ".join(self.fails)
            if self.missing:
                reason += f" (also unavailable: {'; '.join(self.missing)})"
        elif self.missing:
            status, reason = "unavailable", "; ".join(self.missing)
        else:
            status, reason = "pass", ok_reason
        return CheckResult(id=check_id, name=NAMES[check_id], status=status, reason=reason, figures=figures)


def _tri(f: _Findings, value: bool | None, what: str, fail_text: str, missing_text: str) -> None:
    if value is False:
        f.fail(f"{what} {fail_text}")
    elif value is None:
        f.miss(f"{what} {missing_text}")


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def check_pinned(r: Receipt, policy: Policy) -> CheckResult:
    """1: the candidate resource, the exact parent (resolves and loads), the snapshots and the evaluator."""
    p, plan, cfg = r.plan.parent, r.plan, policy.checks.pinned
    f = _Findings()
    _tri(f, p.resolves, f"parent {p.resource_id}", "does not resolve", "was not checked to resolve")
    _tri(f, p.loads, f"parent {p.resource_id}", "does not load", "was not checked to load")
    if cfg.require_parent_weights_hash and not p.weights_hash:
        f.miss("parent weights hash not recorded")
    c = r.candidate
    if c is None:
        f.miss("candidate artifact not recorded")
    else:
        if c.resource_id != plan.candidate_id:
            f.fail(f"candidate artifact {c.resource_id} is not the planned candidate {plan.candidate_id}")
        if c.parent_id != p.resource_id:
            f.fail(f"candidate was derived from {c.parent_id}, not the planned parent {p.resource_id}")
        if cfg.require_candidate_weights_hash and not c.weights_hash:
            f.miss("candidate weights hash not recorded")
    pins = {
        "train snapshot": plan.train_snapshot.snapshot_id,
        "train snapshot hash": plan.train_snapshot.content_hash,
        "held-out snapshot": plan.holdout_snapshot.snapshot_id,
        "held-out snapshot hash": plan.holdout_snapshot.content_hash,
        "evaluator version": plan.evaluator.version,
        "code revision": plan.code_revision,
    }
    for what, value in pins.items():
        if value.strip().lower() in UNPINNED:
            f.fail(f"{what} {value!r} is not pinned")
    figures = {
        "candidate_id": plan.candidate_id,
        "candidate_weights_hash": c.weights_hash if c else None,
        "parent_id": p.resource_id,
        "parent_uri": p.uri,
        "parent_weights_hash": p.weights_hash,
        "parent_resolves": p.resolves,
        "parent_loads": p.loads,
        "train_snapshot": plan.train_snapshot.snapshot_id,
        "holdout_snapshot": plan.holdout_snapshot.snapshot_id,
        "evaluator": f"{plan.evaluator.name}@{plan.evaluator.version}",
        "code_revision": plan.code_revision,
    }
    return f.result(1, "candidate, exact parent (resolves, loads), snapshots and evaluator pinned", figures)


def check_coverage(r: Receipt, policy: Policy) -> CheckResult:
    """2: every planned rollout finished with at least one span of each expected family for its kind.
    Unfinished rollouts and rollouts never recorded count as incomplete; unreadable spans as unknown."""
    ev, f = r.rollouts, _Findings()
    need = policy.checks.coverage.min_complete_share
    if ev is None:
        f.miss("no rollout evidence recorded")
        return f.result(2, "", {"min_complete_share": need})
    column = {fam: j for j, fam in enumerate(ev.families)}
    expected = r.plan.expected_span_families
    # per kind: the column of each expected family (-1: no span of that family was seen at all)
    required: dict[RolloutKind, list[tuple[str, int]] | None] = {
        kind: None if kind not in expected else [(fam, column.get(fam, -1)) for fam in expected[kind]]
        for kind in set(ev.kinds)
    }
    complete = unknown = incomplete = unfinished = 0
    missing_by_family: Counter[str] = Counter()
    succeeded = RolloutStatus.succeeded
    for kind, status, row in zip(ev.kinds, ev.statuses, ev.span_counts, strict=True):
        if status is not succeeded:
            unfinished += 1
            continue
        req = required[kind]
        if req is None or row is None:
            unknown += 1
            continue
        gaps = [fam for fam, j in req if j < 0 or row[j] == 0]
        if gaps:
            incomplete += 1
            missing_by_family.update(gaps)
        else:
            complete += 1
    recorded = Counter(ev.kinds)
    planned_by_kind = {k: max(n, (r.plan.expected_rollouts or {}).get(k, 0)) for k, n in recorded.items()}
    for k, n in (r.plan.expected_rollouts or {}).items():
        planned_by_kind.setdefault(k, n)
    planned = sum(planned_by_kind.values())
    never_recorded = planned - len(ev.kinds)
    undeclared = sorted(k.value for k, req in required.items() if req is None)
    figures = {
        "planned": planned,
        "recorded": len(ev.kinds),
        "never_recorded": never_recorded,
        "unfinished": unfinished,
        "finished_incomplete": incomplete,
        "unknown": unknown,
        "complete": complete,
        "complete_share": _r(complete / planned) if planned else None,
        "min_complete_share": need,
        "missing_by_family": dict(sorted(missing_by_family.items())),
        "spans": ev.total_spans,
    }
    if planned == 0:
        f.miss("no rollouts planned or recorded")
        return f.result(2, "", figures)
    summary = f"{complete} of {planned} rollouts complete (need share {need})"
    if (complete + unknown) / planned < need:
        f.fail(
            f"{summary}: {unfinished} unfinished, {incomplete} finished without every expected span"
            f" family, {never_recorded} never recorded"
        )
    elif complete / planned < need:
        if undeclared:
            f.miss(f"the plan declares no expected span families for kinds {undeclared}")
        f.miss(f"{summary}: coverage of {unknown} finished rollouts is unknown")
    return f.result(2, summary, figures)


def check_retries(r: Receipt, policy: Policy) -> CheckResult:
    """3: retries beyond the plan's budget (sample and infrastructure counted apart), plus retries whose
    kind was never classified (a second `first` attempt), are unexpected retry debt."""
    ev, f = r.rollouts, _Findings()
    limit = policy.checks.retries.max_unexpected_retries
    budget = r.plan.retry_budget
    if ev is None:
        f.miss("no rollout evidence recorded")
        return f.result(3, "", {"max_unexpected_retries": limit})
    kinds = Counter(ev.attempt_retry_kinds)
    first_rollouts = {
        i for i, k in zip(ev.attempt_rollout, ev.attempt_retry_kinds, strict=True) if k is RetryKind.first
    }
    unclassified = kinds[RetryKind.first] - len(first_rollouts)
    sample, infra = kinds[RetryKind.sample], kinds[RetryKind.infrastructure]
    excess_sample = max(0, sample - budget.expected_sample_retries)
    excess_infra = max(0, infra - budget.infrastructure_retries)
    unexpected = excess_sample + excess_infra + unclassified
    retried_reasons = Counter(
        reason or "unknown"
        for reason, ending in zip(ev.attempt_reasons, ev.attempt_endings, strict=True)
        if ending is not AttemptState.succeeded
    )
    figures = {
        "attempts": len(ev.attempt_rollout),
        "sample_retries": sample,
        "infrastructure_retries": infra,
        "unclassified_retries": unclassified,
        "budget_sample_retries": budget.expected_sample_retries,
        "budget_infrastructure_retries": budget.infrastructure_retries,
        "unexpected_retries": unexpected,
        "max_unexpected_retries": limit,
        "endings": {
            k.value: v for k, v in sorted(Counter(ev.attempt_endings).items(), key=lambda kv: kv[0].value)
        },
        "unsuccessful_reasons": dict(retried_reasons.most_common(10)),
    }
    if not ev.attempt_rollout and ev.rollout_ids:
        f.miss(f"no attempts recorded for {len(ev.rollout_ids)} rollouts")
    elif unexpected > limit:
        f.fail(
            f"{unexpected} unexpected retries (limit {limit}): {excess_sample} sample retries over budget,"
            f" {excess_infra} infrastructure retries over budget, {unclassified} unclassified"
        )
    return f.result(3, f"retry debt {unexpected} within limit {limit}", figures)


def check_holdout(r: Receipt, policy: Policy) -> CheckResult:
    """4: on the closed held-out set, same evaluator, the candidate beats its exact parent by the margin."""
    h, f, cfg, plan = r.holdout, _Findings(), policy.checks.holdout, r.plan
    if h is None:
        f.miss("no held-out comparison recorded")
        return f.result(4, "", {"min_margin": cfg.min_margin, "min_n": cfg.min_n})
    if h.parent_id != plan.parent.resource_id:
        f.fail(f"compared against {h.parent_id}, not the exact parent {plan.parent.resource_id}")
    if h.candidate_id != plan.candidate_id:
        f.fail(f"evaluated {h.candidate_id}, not the planned candidate {plan.candidate_id}")
    if h.snapshot_id != plan.holdout_snapshot.snapshot_id:
        f.fail(f"held-out snapshot {h.snapshot_id} is not the pinned {plan.holdout_snapshot.snapshot_id}")
    if h.evaluator != plan.evaluator:
        f.fail(
            f"evaluator {h.evaluator.name}@{h.evaluator.version} is not the pinned"
            f" {plan.evaluator.name}@{plan.evaluator.version}"
        )
    n = cand = par = 0.0
    unscored = 0  # tasks of families lacking a score on one side
    per_family = {}
    for s in h.families:
        per_family[s.family] = {
            "n": s.n,
            "candidate": _r(s.candidate_mean),
            "parent": _r(s.parent_mean),
            "delta": _r(
                None
                if s.candidate_mean is None or s.parent_mean is None
                else s.candidate_mean - s.parent_mean
            ),
        }
        if s.n == 0:
            continue
        if s.candidate_mean is None or s.parent_mean is None:
            f.miss(f"family {s.family} lacks a {'candidate' if s.candidate_mean is None else 'parent'} score")
            unscored += s.n
            continue
        n += s.n
        cand += s.n * s.candidate_mean
        par += s.n * s.parent_mean
    margin = (cand - par) / n if n else None
    figures = {
        "n": int(n),
        "candidate_mean": _r(cand / n) if n else None,
        "parent_mean": _r(par / n) if n else None,
        "margin": _r(margin),
        "min_margin": cfg.min_margin,
        "min_n": cfg.min_n,
        "families": per_family,
    }
    if n + unscored < cfg.min_n:
        f.fail(f"only {int(n + unscored)} held-out tasks in the comparison (need {cfg.min_n})")
    if n == 0:
        f.miss("no held-out task was scored on both sides")
    elif not unscored:
        # The margin is judged on the whole closed set only; rounding keeps float noise
        # (0.05 - 0.03 = 0.0200000001) from deciding a tie.
        if round(margin, 9) < cfg.min_margin:
            f.fail(f"margin {margin:+.4f} over the exact parent is below {cfg.min_margin:+.4f}")
    return f.result(4, f"candidate beats exact parent by {margin or 0:+.4f} on {int(n)} tasks", figures)


def check_protected(r: Receipt, policy: Policy) -> CheckResult:
    """5: protected cases regress at most the policy's tolerance per family (zero by default)."""
    pr, f, cfg, plan = r.protected, _Findings(), policy.checks.protected, r.plan
    if pr is None or not pr.families:
        f.miss("no protected-case results recorded")
        return f.result(5, "", {"default_tolerance": cfg.default_tolerance})
    if pr.parent_id != plan.parent.resource_id:
        f.fail(
            f"protected cases compared against {pr.parent_id}, not the exact parent {plan.parent.resource_id}"
        )
    if pr.candidate_id != plan.candidate_id:
        f.fail(f"protected cases evaluated {pr.candidate_id}, not the planned candidate {plan.candidate_id}")
    families = {}
    for fam in pr.families:
        tol = cfg.for_family(fam.family)
        families[fam.family] = {
            "n": fam.n,
            "regressed": len(fam.regressed),
            "tolerance": tol,
            "missing": fam.missing,
        }
        if len(fam.regressed) > tol:
            f.fail(
                f"family {fam.family}: {len(fam.regressed)} regressed (tolerance {tol}): {', '.join(fam.regressed[:10])}"
            )
        if fam.missing:
            f.miss(f"family {fam.family}: {fam.missing} of {fam.n} cases have no result")
    regressed = [c for fam in pr.families for c in fam.regressed]
    figures = {
        "cases": sum(fam.n for fam in pr.families),
        "regressed": len(regressed),
        "regressed_cases": regressed[:50],
        "families": families,
    }
    return f.result(5, f"{len(regressed)} protected regressions, within tolerance", figures)


def check_canary(r: Receipt, policy: Policy) -> CheckResult:
    """6: the bounded canary ran the candidate within its limits, every task's destination was verified
    (at least the policy's share) and no harmful effect was recorded."""
    c, f, need = r.canary, _Findings(), policy.checks.canary.min_verified_share
    if c is None:
        f.miss("no canary recorded")
        return f.result(6, "", {"min_verified_share": need})
    if c.serving_resource_id != r.plan.candidate_id:
        f.fail(f"canary served {c.serving_resource_id}, not the candidate {r.plan.candidate_id}")
    lim, use = c.limits, c.usage
    if len(c.tasks) > lim.max_tasks:
        f.fail(f"{len(c.tasks)} canary tasks exceed the limit of {lim.max_tasks}")
    if use is None:
        f.miss("canary usage (time, tools, cost, side effects) not recorded")
    else:
        if use.tasks > lim.max_tasks:
            f.fail(f"canary ran {use.tasks} tasks, limit {lim.max_tasks}")
        if use.seconds > lim.max_seconds:
            f.fail(f"canary ran {use.seconds:.0f} s, limit {lim.max_seconds:.0f} s")
        if use.cost > lim.max_cost:
            f.fail(f"canary cost {use.cost}, limit {lim.max_cost}")
        if extra := sorted(set(use.tools_used) - set(lim.allowed_tools)):
            f.fail(f"canary used tools outside its limits: {extra}")
        if extra := sorted(set(use.side_effects) - set(lim.allowed_side_effects)):
            f.fail(f"canary had side effects outside its limits: {extra}")
    outside = sorted(
        {t.destination for t in c.tasks if t.destination and t.destination not in lim.allowed_side_effects}
    )
    if outside:
        f.fail(f"canary tasks wrote to destinations outside its limits: {outside}")
    verified = sum(t.verified for t in c.tasks)
    weaker = [
        {"task_id": t.task_id, "evidence": t.evidence, "uncertainty": t.uncertainty}
        for t in c.tasks
        if not t.verified
    ]
    harmful = [t.task_id for t in c.tasks if t.harmful_effect]
    unrecorded = [t.task_id for t in c.tasks if t.harmful_effect is None]
    share = verified / len(c.tasks) if c.tasks else None
    figures = {
        "serving_resource_id": c.serving_resource_id,
        "tasks": len(c.tasks),
        "verified": verified,
        "verified_share": _r(share),
        "min_verified_share": need,
        "weaker_evidence": weaker,
        "harmful": harmful,
        "harm_unrecorded": len(unrecorded),
        "limits": lim.model_dump(),
        "usage": use.model_dump() if use else None,
    }
    if not c.tasks:
        f.miss("the canary recorded no tasks")
    elif share < need:
        f.fail(f"{verified} of {len(c.tasks)} canary outcomes verified (need share {need})")
    if harmful:
        f.fail(f"harmful effects recorded on {harmful}")
    if unrecorded:
        f.miss(f"no harm record for {len(unrecorded)} canary tasks")
    return f.result(
        6, f"{verified} of {len(c.tasks)} canary outcomes verified, no harm, within limits", figures
    )


def check_rollback_and_approval(r: Receipt, policy: Policy) -> CheckResult:
    """7: the rollback drill resolved and loaded the exact parent and routed back to it, and every role the
    policy requires approved the canary step, each role being one the plan authorises."""
    d, f, plan = r.rollback_drill, _Findings(), r.plan
    required = policy.checks.approval.required_roles
    if d is None:
        f.miss("no rollback drill recorded")
    else:
        if d.parent_id != plan.parent.resource_id:
            f.fail(f"rollback drill targeted {d.parent_id}, not the exact parent {plan.parent.resource_id}")
        _tri(f, d.resolved, "rollback target", "did not resolve", "resolution was not tested")
        _tri(f, d.loaded, "rollback target", "did not load", "loading was not tested")
        _tri(f, d.routed_back, "routing", "did not return to the parent", "return was not tested")
    canary_approvals = [a for a in r.approvals if a.step == "canary"]
    unauthorised = [a for a in canary_approvals if a.role not in plan.approvers.canary]
    roles = {a.role for a in canary_approvals if a.role in plan.approvers.canary}
    for a in unauthorised:
        f.fail(f"{a.actor} approved as {a.role}, a role the plan does not authorise for the canary")
    if not_authorisable := sorted(set(required) - set(plan.approvers.canary)):
        f.fail(f"the plan does not authorise required roles {not_authorisable}")
    elif absent := sorted(set(required) - roles):
        f.miss(f"no approval yet from required roles {absent}")
    figures = {
        "drill": d.model_dump() if d else None,
        "approvals": [a.model_dump() for a in canary_approvals],
        "required_roles": required,
        "authorised_roles": plan.approvers.canary,
    }
    return f.result(7, "rollback drill passed and the required roles approved", figures)


CHECKS: dict[int, tuple[str, Callable[[Receipt, Policy], CheckResult]]] = {
    1: ("pinned identity", check_pinned),
    2: ("span coverage", check_coverage),
    3: ("retry debt", check_retries),
    4: ("held-out vs exact parent", check_holdout),
    5: ("protected cases", check_protected),
    6: ("bounded canary", check_canary),
    7: ("rollback and approval", check_rollback_and_approval),
}
NAMES = {i: name for i, (name, _) in CHECKS.items()}


def run_checks(receipt: Receipt, policy: Policy) -> list[CheckResult]:
    return [fn(receipt, policy) for _, fn in CHECKS.values()]


def evaluate(
    receipt: Receipt, policy: Policy, current_fingerprints: Mapping[str, str | None] | None = None
) -> Evaluation:
    """Run the seven checks, void the ones staleness affects, and decide the verdict."""
    checks = run_checks(receipt, policy)
    void = void_checks(
        receipt.fingerprints, current_fingerprints, required=policy.staleness.required_fingerprints
    )
    hold: list[str] = []
    for c in checks:
        c.void = void.get(c.id, [])
        if c.status != "pass":
            hold.append(f"check {c.id} ({c.name}) {c.status}: {c.reason}")
        if c.void:
            hold.append(f"check {c.id} ({c.name}) void: {'; '.join(c.void)}")
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
