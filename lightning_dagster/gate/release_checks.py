"""Checks 4 to 7, on the candidate against its exact parent and in the world: held-out margin, protected
cases, bounded canary, rollback and approval."""

from __future__ import annotations

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.findings import CheckResult, Findings, rounded
from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt_models import Receipt
from lightning_dagster.gate.stage_table import CANARY, DRILL, EVALUATION, NO_CAUSES, Causes, not_run


def check_heldout_margin(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """On the closed held-out set, same evaluator, the candidate beats its exact parent by the margin."""
    h, f, cfg, plan = r.holdout, Findings(), policy.checks.heldout_margin, r.plan
    if h is None:
        f.miss(not_run(EVALUATION, causes, "no held-out comparison recorded"))
        return f.result(Check.heldout_margin, "", {"min_margin": cfg.min_margin, "min_n": cfg.min_n})
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
        both = s.candidate_mean is not None and s.parent_mean is not None
        per_family[s.family] = {
            "n": s.n,
            "candidate": rounded(s.candidate_mean),
            "parent": rounded(s.parent_mean),
            "delta": rounded(s.candidate_mean - s.parent_mean if both else None),
        }
        if s.n == 0:
            continue
        if not both:
            f.miss(f"family {s.family} lacks a {'candidate' if s.candidate_mean is None else 'parent'} score")
            unscored += s.n
            continue
        n += s.n
        cand += s.n * s.candidate_mean
        par += s.n * s.parent_mean
    margin = (cand - par) / n if n else None
    figures = {
        "n": int(n),
        "candidate_mean": rounded(cand / n) if n else None,
        "parent_mean": rounded(par / n) if n else None,
        "margin": rounded(margin),
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
    return f.result(
        Check.heldout_margin, f"candidate beats exact parent by {margin or 0:+.4f} on {int(n)} tasks", figures
    )


def check_protected_cases(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """Protected cases regress at most the policy's tolerance per family (zero by default)."""
    pr, f, cfg, plan = r.protected, Findings(), policy.checks.protected_cases, r.plan
    if pr is None or not pr.families:
        f.miss(not_run(EVALUATION, causes, "no protected-case results recorded"))
        return f.result(Check.protected_cases, "", {"default_tolerance": cfg.default_tolerance})
    if pr.parent_id != plan.parent.resource_id:
        f.fail(
            f"protected cases compared against {pr.parent_id}, not the exact parent {plan.parent.resource_id}"
        )
    if pr.candidate_id != plan.candidate_id:
        f.fail(f"protected cases evaluated {pr.candidate_id}, not the planned candidate {plan.candidate_id}")
    families = {}
    for fam in pr.families:
        tol = cfg.tolerance.get(fam.family, cfg.default_tolerance)
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
    return f.result(
        Check.protected_cases, f"{len(regressed)} protected regressions, within tolerance", figures
    )


def check_canary_verified(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """The bounded canary ran the candidate within its limits, verified and without harm."""
    c, f, need = r.canary, Findings(), policy.checks.canary_verified.min_verified_share
    if c is None:
        f.miss(not_run(CANARY, causes, "no canary recorded"))
        return f.result(Check.canary_verified, "", {"min_verified_share": need})
    if c.serving_resource_id != r.plan.candidate_id:
        f.fail(f"canary served {c.serving_resource_id}, not the candidate {r.plan.candidate_id}")
    lim, use, caps = c.limits, c.usage, policy.checks.canary_verified
    for name in ("max_tasks", "max_seconds", "max_cost"):  # a receipt cannot raise its own limits
        if getattr(lim, name) > getattr(caps, name):
            f.fail(f"canary.limits.{name} {getattr(lim, name)} exceeds the policy's {getattr(caps, name)}")
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
        "verified_share": rounded(share),
        "min_verified_share": need,
        "weaker_evidence": weaker,
        "harmful": harmful,
        "harm_unrecorded": len(unrecorded),
        "limits": lim.model_dump(),
        "usage": use.model_dump() if use else None,
    }
    if c.unverifiable:  # the effect check cannot be made: unavailable for that reason, never a pass
        figures.update(unverifiable=c.unverifiable, weaker_evidence=[])
        f.miss(f"effect check unavailable: {c.unverifiable}")
    elif not c.tasks:
        f.miss("the canary recorded no tasks")
    elif share < need:
        f.fail(f"{verified} of {len(c.tasks)} canary outcomes verified (need share {need})")
    if harmful:
        f.fail(f"harmful effects recorded on {harmful}")
    if unrecorded and not c.unverifiable:
        f.miss(f"no harm record for {len(unrecorded)} canary tasks")
    return f.result(
        Check.canary_verified,
        f"{verified} of {len(c.tasks)} canary outcomes verified, no harm, within limits",
        figures,
    )


def check_rollback_and_approval(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """The rollback drill returned to the exact parent, and every required role approved the canary step."""
    d, f, plan = r.rollback_drill, Findings(), r.plan
    required = policy.checks.rollback_and_approval.required_roles
    if d is None:
        f.miss(not_run(DRILL, causes, "no rollback drill recorded"))
    else:
        if d.parent_id != plan.parent.resource_id:
            f.fail(f"rollback drill targeted {d.parent_id}, not the exact parent {plan.parent.resource_id}")
        f.tri(d.resolved, "rollback target", "did not resolve", "resolution was not tested")
        f.tri(d.loaded, "rollback target", "did not load", "loading was not tested")
        f.tri(d.routed_back, "routing", "did not return to the parent", "return was not tested")
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
    return f.result(
        Check.rollback_and_approval, "rollback drill passed and the required roles approved", figures
    )
