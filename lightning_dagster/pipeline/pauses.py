"""The continual-learning loop's pauses and resumes, kept in the store as one hash-chained document
(collection `loop_decisions`, one version per decision), and the signed resume an authorized actor records.

The decisions themselves are the gate's (`gate.pauses`); this module reads and appends them. Each version's
content hash covers the decision and the previous version's hash, so an edited history does not verify.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.gate.pauses import (
    LOOP,
    LoopDecision,
    ResumeRequest,
    actor_resume,
    next_decision,
    resume_message,
    resume_problem,
)
from lightning_dagster.pipeline.results import Table

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence

    from lightning_dagster.gate.approvals import ActorKey
    from lightning_dagster.store import Store

COLLECTION = "loop_decisions"


class ResumeRefused(Exception):
    """A resume that is not an authorized actor's signed decision over the pause in force."""


class TamperedHistory(Exception):
    """A recorded decision whose hash or chain does not verify."""


@dataclass(frozen=True)
class Recorded:
    version: int
    hash: str
    decision: LoopDecision
    recorded_at: float


def _hash(body: dict[str, Any], previous: str | None) -> str:
    return content_hash({"decision": body, "previous_hash": previous})


def history(store: Store, loop: str = LOOP) -> list[Recorded]:
    """Every decision, oldest first, each verified against its hash and its predecessor's."""
    out: list[Recorded] = []
    previous = None
    for doc in store.document_versions(COLLECTION, loop):
        if doc.previous_hash != previous or doc.content_hash != _hash(doc.body, previous):
            raise TamperedHistory(f"{COLLECTION}/{loop} version {doc.version} does not verify")
        out.append(
            Recorded(doc.version, doc.content_hash, LoopDecision.model_validate(doc.body), doc.created_at)
        )
        previous = doc.content_hash
    return out


def _append(store: Store, decision: LoopDecision, head: Recorded | None) -> Recorded:
    """Append after `head` (compare-and-set: a concurrent decision makes this a `Conflict`)."""
    body = decision.model_dump(mode="json")
    previous = head.hash if head else None
    digest = _hash(body, previous)
    version = store.append_document(COLLECTION, decision.loop, digest, body, previous)
    return Recorded(version, digest, decision, time.time())


@dataclass(frozen=True)
class LoopState:
    paused: bool
    reason: str
    receipt_id: str | None
    recorded: Recorded | None  # the decision this tick recorded, if any


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
) -> LoopState:
    """Record the decision the gate's rule makes now (if any) and return the loop's state after it."""
    from lightning_dagster.store.errors import Conflict

    for _ in range(3):  # a concurrent tick or resume moved the head: decide again on the new history
        past = history(store)
        decision = next_decision(
            [r.decision for r in past], latest_receipt, receipt_conditions, live_conditions, time.time()
        )
        try:
            recorded = None if decision is None else _append(store, decision, past[-1] if past else None)
        except Conflict:
            continue
        last = recorded or (past[-1] if past else None)
        if last is None or last.decision.action == "resume":
            return LoopState(False, "no stop condition holds", latest_receipt, recorded)
        pause = last.decision
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(pause.at))
        reason = f"{describe(pause)}; paused since {when}; resume: `lightning-dagster loop resume`"
        return LoopState(True, reason, pause.receipt_id, recorded)
    raise Conflict(f"{COLLECTION}/{LOOP}: the history kept moving under three attempts to decide")


def current_pause(store: Store, loop: str = LOOP) -> Recorded | None:
    past = history(store, loop)
    return past[-1] if past and past[-1].decision.action == "pause" else None


def sign_resume(
    store: Store, *, actor: str, role: str, key: Path | str, reason: str, at: float | None = None
) -> ResumeRequest:
    """`actor`'s resume of the pause in force, signed with the private key file `key`."""
    from lightning_dagster.registry.signing import load_private_key, sign

    pause = current_pause(store)
    if pause is None:
        raise ResumeRefused(f"resume by {actor}: the loop is not paused")
    at = time.time() if at is None else at
    signature = sign(load_private_key(key), resume_message(pause.hash, actor, role, reason, at))
    return ResumeRequest(
        actor=actor, role=role, reason=reason, at=at, pause_hash=pause.hash, signature=signature
    )


def resume(
    store: Store,
    request: ResumeRequest,
    *,
    actors: Mapping[str, ActorKey],
    allowed_roles: Collection[str],
) -> Recorded:
    """Record `request` as the resume of the pause in force once it verifies against the deployment's
    pinned approvers (`actors`) and the roles that may resume; otherwise `ResumeRefused`, nothing recorded."""
    pause = current_pause(store)
    problem = resume_problem(request, pause.hash if pause else None, actors, allowed_roles)
    if problem is not None or pause is None:
        raise ResumeRefused(problem or "the loop is not paused")
    return _append(store, actor_resume(request, pause.decision), pause)


def history_table(store: Store, *, last: int = 50) -> Table:
    """The newest `last` decisions as a table, oldest first."""
    rows = [
        [
            r.version,
            time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.decision.at)),
            r.decision.action,
            r.decision.by if r.decision.by != "actor" else f"actor {r.decision.actor}",
            r.decision.receipt_id,
            describe(r.decision),
        ]
        for r in history(store)[-last:]
    ]
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
