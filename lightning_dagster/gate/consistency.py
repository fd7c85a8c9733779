"""Cross-field validations the gate runs before it judges: an inconsistency fails the check whose evidence it
touches; a field they need but lack makes that check unavailable."""

from __future__ import annotations

import datetime as dt
import math
import time
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from itertools import combinations

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.findings import Findings
from lightning_dagster.gate.hashing import fingerprint
from lightning_dagster.gate.receipt_models import Receipt, SnapshotRef
from lightning_dagster.release.approvals import approval_problems
from lightning_dagster.release.signing import ActorKey
from lightning_dagster.types import AttemptState, RolloutKind, RolloutStatus

# Seconds a recorded time may lie ahead of the judging clock (machines' clocks differ a little).
CLOCK_SKEW_S = 300.0

# actor -> the roles they hold and their public key: the deployment's pinned approvers
KnownActors = Mapping[str, ActorKey]
SPLITS = ("train", "holdout", "protected", "canary")
# Fields naming an artifact: the candidate's equal to its parent's, the candidate is no new artifact.
ARTIFACT_FIELDS = ("resource_id", "uri", "weights_hash", "model_version")
# canary limit -> the fingerprint the plan recorded of it (sorted), so the canary cannot widen its own
CANARY_FINGERPRINTS = {"allowed_tools": "permissions", "allowed_side_effects": "destinations"}


def inconsistencies(
    receipt: Receipt,
    *,
    roles: KnownActors | None = None,
    now: float | None = None,
    clock_skew_s: float = CLOCK_SKEW_S,
    earlier: Collection[str] = (),
) -> dict[Check, Findings]:
    """Per check, the contradictions (failures) and missing fields (unavailable); with `roles`, every
    approval must verify (a canary one: maybe over `earlier` evidence) and be recorded once."""
    if not math.isfinite(clock_skew_s) or clock_skew_s < 0:
        # a NaN skew would compare false with every time and let any future time through
        raise ValueError(f"clock skew must be a finite number of seconds >= 0, not {clock_skew_s!r}")
    out = {check: Findings() for check in Check}
    _timeline(receipt, out, (time.time() if now is None else now) + clock_skew_s, clock_skew_s)
    _rollouts(receipt, out)
    _closed_sets(receipt, out)
    _identities(receipt, out[Check.pinned])
    _canary(receipt, out[Check.canary_verified])
    for problem in approval_problems(receipt, roles, earlier) if roles is not None else ():
        out[Check.rollback_and_approval].fail(problem + ("" if roles else " (no approvers were given)"))
    return out


def _repeated(values: Iterable[str]) -> list[str]:
    return sorted(v for v, n in Counter(values).items() if n > 1)


def _identities(r: Receipt, f: Findings) -> None:
    """The candidate is not its parent; the plan's splits are different sets (an empty one aside)."""
    cand, parent = r.candidate, r.plan.parent
    for field in ARTIFACT_FIELDS if cand is not None else ():
        if (value := getattr(cand, field)) and value == getattr(parent, field):
            f.fail(f"candidate {field.replace('_', ' ')} equals the parent's ({value}): no new artifact")
    refs = [(split, ref) for split in SPLITS if (ref := getattr(r.plan, f"{split}_snapshot")) is not None]
    for (a, x), (b, y) in combinations(refs, 2):
        empty = 0 in (x.n_tasks, y.n_tasks)
        if x.snapshot_id == y.snapshot_id or x.content_hash == y.content_hash and not empty:
            f.fail(f"plan.{a}_snapshot is plan.{b}_snapshot ({x.snapshot_id}): splits must be disjoint")


def _iso(t: float) -> str:
    try:
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):
        return repr(t)


def _timeline(r: Receipt, out: dict[Check, Findings], latest: float, skew: float) -> None:
    """Plan, training, evaluation, canary and the default's approval happen in that order, none after `latest`
    (entries: stage rank, what, time, the check it feeds); a recorded section without a time is missing."""
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
    # These only follow the plan: the canary is approved before training, the drill may run any time.
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
    if dup := _repeated(ev.rollout_ids):
        problems.append(f"rollout ids are not unique ({len(dup)} recorded more than once, e.g. {dup[0]!r})")
    if dup := _repeated(ev.families):
        problems.append(f"rollouts.families lists span families more than once: {dup}")
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
    """Each family once, the plan's with their planned sizes (or adding up to the set's size)."""
    if dup := _repeated(name for name, _ in families):
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
    """Each canary task once and planned, a verified one re-read; tools and destinations as fingerprinted."""
    c, pinned = r.canary, r.plan.canary_snapshot
    if c is None:
        return
    if dup := _repeated(t.task_id for t in c.tasks):
        f.fail(f"canary tasks recorded more than once: {dup[:5]}")
    if pinned is None or pinned.task_ids is None:
        f.miss("the plan lists no canary tasks (plan.canary_snapshot.task_ids) to hold the canary's to")
    elif outside := sorted({t.task_id for t in c.tasks} - set(pinned.task_ids)):
        f.fail(f"canary tasks {outside[:5]} are not among the plan's (plan.canary_snapshot.task_ids)")
    for k, t in enumerate(c.tasks):
        if t.verified and (not t.destination or t.uncertainty):
            why = f"uncertainty {t.uncertainty}" if t.destination else "no destination"
            f.fail(f"canary.tasks.{k} ({t.task_id}) is verified with {why}: nothing was re-read")
    for field, name in CANARY_FINGERPRINTS.items():
        recorded = getattr(r.fingerprints, name)
        if recorded is not None and fingerprint(sorted(getattr(c.limits, field))) != recorded:
            f.fail(f"canary.limits.{field} is not what the plan fingerprinted (fingerprints.{name})")
    if c.usage is not None and c.usage.tasks != len(c.tasks):
        f.fail(f"canary usage says {c.usage.tasks} tasks, the report lists {len(c.tasks)}")
    planned = (r.plan.expected_rollouts or {}).get(RolloutKind.canary)
    if planned is not None and planned != len(c.tasks):
        f.fail(f"the plan asks for {planned} canary tasks, the report lists {len(c.tasks)}")
