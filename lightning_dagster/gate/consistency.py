"""Evidence that must agree with itself: the cross-field validations the gate runs before it judges. An
inconsistency fails the check whose evidence it touches; a field they need but lack makes it unavailable.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections import Counter
from collections.abc import Mapping

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.findings import Findings
from lightning_dagster.gate.receipt_models import Receipt, SnapshotRef
from lightning_dagster.release.approvals import approval_problem, evidence_hash
from lightning_dagster.release.signing import ActorKey
from lightning_dagster.types import AttemptState, RolloutKind, RolloutStatus

# Seconds a recorded time may lie ahead of the judging clock (machines' clocks differ a little).
CLOCK_SKEW_S = 300.0

# actor -> the roles they hold and their public key: the deployment's pinned approvers
KnownActors = Mapping[str, ActorKey]


def inconsistencies(
    receipt: Receipt,
    *,
    roles: KnownActors | None = None,
    now: float | None = None,
    clock_skew_s: float = CLOCK_SKEW_S,
) -> dict[Check, Findings]:
    """Per check, the contradictions (failures) and missing fields (unavailable) found in the receipt."""
    if not math.isfinite(clock_skew_s) or clock_skew_s < 0:
        # a NaN skew would compare false with every time and let any future time through
        raise ValueError(f"clock skew must be a finite number of seconds >= 0, not {clock_skew_s!r}")
    out = {check: Findings() for check in Check}
    _timeline(receipt, out, (time.time() if now is None else now) + clock_skew_s, clock_skew_s)
    _rollouts(receipt, out)
    _closed_sets(receipt, out)
    _canary(receipt, out[Check.canary_verified])
    _approvers(receipt, out[Check.rollback_and_approval], roles)
    cand, parent = receipt.candidate, receipt.plan.parent
    if cand is not None and cand.weights_hash and cand.weights_hash == parent.weights_hash:
        out[Check.pinned].fail(
            f"candidate weights hash equals the parent's ({parent.weights_hash}): nothing was trained (an RL"
            " step changes the weights only where rewards within a group differ)"
        )
    return out


def _iso(t: float) -> str:
    try:
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):
        return repr(t)


def _timeline(r: Receipt, out: dict[Check, Findings], latest: float, skew: float) -> None:
    """Plan, training, evaluation, canary and the approval of the default happen in that order, none after
    now plus skew. Each time is compared with the latest time recorded at an earlier stage."""
    # (stage rank, what, time, the check its evidence feeds); a recorded section without its time is missing
    stages: list[tuple[int, str, float | None, Check]] = [(0, "plan", r.plan.created_at, Check.pinned)]
    if r.candidate is not None:
        stages.append((1, "candidate (training)", r.candidate.created_at, Check.pinned))
    if r.holdout is not None:
        stages.append((2, "held-out comparison", r.holdout.at, Check.heldout_margin))
    if r.protected is not None:
        stages.append((2, "protected-case results", r.protected.at, Check.protected_cases))
    if r.canary is not None:
        stages.append((3, "canary", r.canary.at, Check.canary_verified))
    stages += [
        (4, f"approval of the default by {a.actor}", a.at, Check.rollback_and_approval)
        for a in r.approvals
        if a.step == "default"
    ]
    # These follow the plan only: the canary step is approved on the plan, before training runs, and the
    # drill exercises the parent, which it may do at any time.
    after_plan = [
        (1, f"approval of the canary by {a.actor}", a.at, Check.rollback_and_approval)
        for a in r.approvals
        if a.step == "canary"
    ]
    if r.rollback_drill is not None:
        after_plan.append((1, "rollback drill", r.rollback_drill.at, Check.rollback_and_approval))
    for rank, what, at, check in stages + after_plan:
        f = out[check]
        if at is None:
            f.miss(f"{what} has no recorded time")
            continue
        if at > latest:
            f.fail(f"{what} at {_iso(at)} is in the future (now plus {skew:g} s clock skew)")
        earlier = [(t, w) for k, w, t, _ in stages if k < rank and t is not None]
        if earlier and at < (last := max(earlier))[0]:
            f.fail(f"{what} at {_iso(at)} precedes the {last[1]} at {_iso(last[0])}")


def _rollouts(r: Receipt, out: dict[Check, Findings]) -> None:
    """Unique ids; every finished rollout has attempts, and its status agrees with its latest attempt."""
    ev = r.rollouts
    if ev is None:
        return
    problems = []
    if dup := [rid for rid, n in Counter(ev.rollout_ids).items() if n > 1]:
        problems.append(f"rollout ids are not unique ({len(dup)} recorded more than once, e.g. {dup[0]!r})")
    latest: dict[int, AttemptState] = {}
    for i, ending in zip(ev.attempt_rollout, ev.attempt_endings, strict=True):
        latest[i] = ending  # attempts are listed in sequence order within each rollout
    finished = (RolloutStatus.succeeded, RolloutStatus.failed)
    without = [i for i, s in enumerate(ev.statuses) if s in finished and i not in latest]
    if without:
        problems.append(f"{len(without)} of {len(ev.statuses)} finished rollouts have no attempts recorded")
    contradicted = [
        ev.rollout_ids[i]
        for i, s in enumerate(ev.statuses)
        if s in finished
        and i in latest
        and (s is RolloutStatus.succeeded) != (latest[i] is AttemptState.succeeded)
    ]
    if contradicted:
        problems.append(
            f"{len(contradicted)} finished rollouts disagree with their latest attempt's ending"
            f" (e.g. {contradicted[0]!r})"
        )
    for why in problems:
        out[Check.span_coverage].fail(why)
        out[Check.retry_debt].fail(why)


def _planned(ref: SnapshotRef | None, what: str, families: list[tuple[str, int]], f: Findings) -> None:
    """Each family listed once, and the families are the plan's with their planned sizes (or, when the
    plan records only the set's size, add up to it)."""
    if dup := sorted(name for name, k in Counter(name for name, _ in families).items() if k > 1):
        f.fail(f"{what} families listed more than once: {dup}")
    got = dict(families)
    if ref is None:
        f.miss(f"the plan pins no {what} set to compare the results with")
    elif ref.families is not None:
        for fam, n in sorted(ref.families.items()):
            if fam not in got:
                f.fail(f"planned {what} family {fam} ({n} tasks) is missing")
            elif got[fam] != n:
                f.fail(f"{what} family {fam} has n={got[fam]}, the plan has {n} tasks")
        if extra := sorted(set(got) - set(ref.families)):
            f.fail(f"{what} families {extra} are not in the plan")
    elif ref.n_tasks is not None:
        total = sum(n for _, n in families)
        if total != ref.n_tasks:
            f.fail(f"{what} families count {total} tasks, the plan's {what} set has {ref.n_tasks}")
    else:
        f.miss(f"the plan records no size of the {what} set")


def _closed_sets(r: Receipt, out: dict[Check, Findings]) -> None:
    plan = r.plan
    if (h := r.holdout) is not None:
        f = out[Check.heldout_margin]
        _planned(plan.holdout_snapshot, "held-out", [(s.family, s.n) for s in h.families], f)
        for s in h.families:
            if s.distinct_tasks is None:
                f.miss(f"held-out family {s.family} does not record its distinct tasks")
            elif s.distinct_tasks != s.n:
                f.fail(f"held-out family {s.family} has n={s.n} from {s.distinct_tasks} distinct tasks")
    if (pr := r.protected) is not None and pr.families:
        f = out[Check.protected_cases]
        _planned(plan.protected_snapshot, "protected", [(p.family, p.n) for p in pr.families], f)
        pinned = plan.protected_snapshot
        if pinned is not None and pr.snapshot_id is None:
            f.miss("protected results do not name their snapshot")
        elif pinned is not None and pr.snapshot_id != pinned.snapshot_id:
            f.fail(f"protected snapshot {pr.snapshot_id} is not the pinned {pinned.snapshot_id}")


def _canary(r: Receipt, f: Findings) -> None:
    """Each canary task once; usage and the plan count the tasks the report lists."""
    c = r.canary
    if c is None:
        return
    if dup := sorted(t for t, k in Counter(t.task_id for t in c.tasks).items() if k > 1):
        f.fail(f"canary tasks recorded more than once: {dup[:5]}")
    if c.usage is not None and c.usage.tasks != len(c.tasks):
        f.fail(f"canary usage says {c.usage.tasks} tasks, the report lists {len(c.tasks)}")
    planned = (r.plan.expected_rollouts or {}).get(RolloutKind.canary)
    if planned is not None and planned != len(c.tasks):
        f.fail(f"the plan asks for {planned} canary tasks, the report lists {len(c.tasks)}")


def _approvers(r: Receipt, f: Findings, roles: KnownActors | None) -> None:
    if roles is None:
        return
    current = evidence_hash(r)
    for a in r.approvals:
        # A default approval signs the evidence as it stands. A canary approval precedes its own evidence:
        # it signs an earlier version of this receipt, which only the ledger can name (promotion checks
        # that); here its signature must verify over this receipt's id, its step, actor, role and time.
        accepted = {current} if a.step == "default" else {current, a.evidence_hash or current}
        if (problem := approval_problem(r, a, roles, accepted)) is not None:
            f.fail(problem + ("" if roles else " (no approvers were given)"))
