"""The continual-learning loop's pauses and resumes, kept in the store as one hash-chained document
(collection `loop_decisions`), and the signed resume an authorized actor records. The decisions
themselves are `release.pauses`'s; this module reads and appends them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from lightning_dagster.gate.errors import from_validation_error
from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.pipeline.results import Table
from lightning_dagster.release.pauses import (
    LOOP,
    LoopDecision,
    ResumeRequest,
    actor_resume,
    next_decision,
    resume_fields,
    resume_problem,
    resume_roles_of,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from lightning_dagster.release.signing import ActorKey
    from lightning_dagster.store import Store

COLLECTION = "loop_decisions"


class ResumeRefused(Exception):
    """A resume that is not an authorized actor's signed decision over the pause in force."""


class TamperedHistory(Exception):
    """A recorded decision whose hash or chain does not verify, or whose body is not a decision."""


def when(ts: float) -> str:
    """A decision's time as the history shows it; a time no calendar holds is shown as the number it is,
    so one odd record does not make the whole history unreadable."""
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    except (OverflowError, OSError, ValueError):
        return f"{ts!r} (not a calendar time)"


def resume_request(data: Mapping[str, Any]) -> ResumeRequest:
    """A resume's fields as a `ResumeRequest`; a bad field raises the gate's `InvalidInput` naming it."""
    try:
        return ResumeRequest.model_validate(dict(data))
    except ValidationError as err:
        raise from_validation_error("resume", err) from None


@dataclass(frozen=True)
class Recorded:
    version: int
    hash: str
    decision: LoopDecision


def _hash(body: dict[str, Any], previous: str | None) -> str:
    return content_hash({"decision": body, "previous_hash": previous})


def history(store: Store, loop: str = LOOP) -> list[Recorded]:
    """Every decision, oldest first, each verified against its hash and its predecessor's."""
    out: list[Recorded] = []
    previous = None
    for doc in store.document_versions(COLLECTION, loop):
        if doc.previous_hash != previous or doc.content_hash != _hash(doc.body, previous):
            raise TamperedHistory(f"{COLLECTION}/{loop} version {doc.version} does not verify")
        try:
            decision = LoopDecision.model_validate(doc.body)
        except ValidationError as err:
            # Its hash verifies, so it was written around `_append` with a recomputed chain.
            fields = ", ".join(".".join(map(str, e["loc"])) or "<root>" for e in err.errors())
            raise TamperedHistory(
                f"{COLLECTION}/{loop} version {doc.version} is not a loop decision ({fields})"
            ) from None
        out.append(Recorded(doc.version, doc.content_hash, decision))
        previous = doc.content_hash
    return out


def _append(store: Store, decision: LoopDecision, head: Recorded | None) -> Recorded:
    """Append after `head` (compare-and-set: a concurrent decision makes this a `Conflict`)."""
    body, previous = decision.model_dump(mode="json"), head.hash if head else None
    digest = _hash(body, previous)
    version = store.append_document(COLLECTION, decision.loop, digest, body, previous)
    return Recorded(version, digest, decision)


@dataclass(frozen=True)
class LoopState:
    paused: bool
    reason: str
    receipt_id: str | None
    recorded: Recorded | None  # the decision this tick recorded, if any
    head: Recorded | None = None  # the newest recorded decision after this tick

    @property
    def pause(self) -> bool:  # as `triggers.stop_decision`'s readers name it
        return self.paused


def describe(decision: LoopDecision) -> str:
    """One line: what was decided, by whom, on which receipt, why."""
    if decision.action == "pause":
        on = f"receipt {decision.receipt_id}" if decision.receipt_id else "no judged receipt"
        return f"{'; '.join(decision.conditions)} ({on})"
    if decision.by == "actor":
        return f"resumed by {decision.actor} as {decision.role}: {decision.reason}"
    return f"resumed: {decision.reason}"


def tick(
    store: Store,
    latest_receipt: str | None,
    receipt_conditions: Sequence[str],
    live_conditions: Sequence[str],
    *,
    resume_roles: Sequence[str] | None = None,
    record: bool = True,
) -> LoopState:
    """The loop's state after the decision the gate's rule makes now (if any), which is recorded when
    `record` (a pause names `resume_roles` as the roles whose signed resume lifts it). Without `record`
    nothing is written: a decision not yet recorded reads as made, a pause that is not recorded lifts when
    its conditions no longer hold."""
    from lightning_dagster.store.errors import Conflict

    for _ in range(3):  # a concurrent tick or resume moved the head: decide again on the new history
        past = history(store)
        head = past[-1] if past else None
        decisions, now = [r.decision for r in past], time.time()
        decision = next_decision(
            decisions, latest_receipt, receipt_conditions, live_conditions, now, resume_roles=resume_roles
        )
        try:
            recorded = None if decision is None or not record else _append(store, decision, head)
        except Conflict:
            continue
        head = recorded or head
        last = decision or (head.decision if head else None)
        if last is None or last.action == "resume":
            return LoopState(False, "no stop condition holds", latest_receipt, recorded, head)
        unrecorded = decision is not None and not record
        lift = "lifts when it no longer holds" if unrecorded else "resume: `lightning-dagster loop resume`"
        reason = f"{describe(last)}; paused since {when(last.at)}; {lift}"
        return LoopState(True, reason, last.receipt_id, recorded, head)
    raise Conflict(f"{COLLECTION}/{LOOP}: the history kept moving under three attempts to decide")


def current_pause(store: Store, loop: str = LOOP) -> Recorded | None:
    past = history(store, loop)
    return past[-1] if past and past[-1].decision.action == "pause" else None


def pause_roles(pause: Recorded) -> list[str]:
    """The roles whose signed resume lifts the recorded `pause` (`release.pauses.resume_roles_of`)."""
    return resume_roles_of(pause.decision)


def sign_resume(
    store: Store,
    *,
    actor: str,
    role: str | None = None,
    key: Path | str,
    reason: str,
    at: float | None = None,
) -> ResumeRequest:
    """`actor`'s resume of the pause in force in `role`, signed with the private key file `key`."""
    from lightning_dagster.release.signing import LOOP_RESUME, load_private_key, sign

    pause = current_pause(store)
    if pause is None:
        raise ResumeRefused(f"resume by {actor}: the loop is not paused")
    if role is None:
        allowed = pause_roles(pause)
        if not allowed:
            raise ResumeRefused(f"resume by {actor}: the pause in force names no role that may resume it")
        role = allowed[0]
    at = time.time() if at is None else at
    fields = {"actor": actor, "role": role, "reason": reason, "at": at, "pause_hash": pause.hash}
    request = resume_request(fields)  # refuse what could not be recorded before anything is signed
    signature = sign(load_private_key(key), LOOP_RESUME, resume_fields(request))
    return request.model_copy(update={"signature": signature})


def resume(store: Store, request: ResumeRequest, *, actors: Mapping[str, ActorKey]) -> Recorded:
    """Record `request` as the resume of the pause in force once it verifies against the pinned approvers
    (`actors`) and the roles the pause names; otherwise `ResumeRefused`, nothing recorded. A decision
    recorded meanwhile refuses it too: it signed a pause that is no longer the one in force."""
    from lightning_dagster.store.errors import Conflict

    pause = current_pause(store)
    pause_hash, roles, at = (pause.hash, pause_roles(pause), pause.decision.at) if pause else (None, [], None)
    problem = resume_problem(request, pause_hash, actors, roles, paused_at=at)
    if problem is not None or pause is None:
        raise ResumeRefused(problem or "the loop is not paused")
    try:
        return _append(store, actor_resume(request, pause.decision), pause)
    except Conflict:
        raise ResumeRefused(
            f"resume by {request.actor} as {request.role}: another decision was recorded after pause "
            f"{pause.hash} meanwhile; see `lightning-dagster loop status`"
        ) from None


def history_table(store: Store, *, last: int = 50) -> Table:
    """The newest `last` decisions (at least one) as a table, oldest first."""
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be a positive number of decisions, got {last!r}")
    rows = []
    for r in history(store)[-last:]:
        d = r.decision
        by = d.by if d.by != "actor" else f"actor {d.actor}"
        rows.append([r.version, when(d.at), d.action, by, d.receipt_id, describe(d)])
    return Table(columns=["#", "at", "action", "by", "receipt", "detail"], rows=rows)


def decision_metadata(store: Store, recorded: Recorded) -> dict[str, Any]:
    """What the UI shows for a decision: the decision, and the history it joined."""
    d = recorded.decision
    return {
        "loop_decision": d.action,
        "decided_by": d.actor if d.by == "actor" else d.by,
        "detail": describe(d),
        "conditions": d.conditions,
        "receipt_id": d.receipt_id,
        "decision_hash": recorded.hash,
        "loop_history": history_table(store),
    }
