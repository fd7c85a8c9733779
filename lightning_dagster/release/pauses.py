"""Pause and resume of the continual-learning loop as recorded decisions: what a resume signs
(`signing.LOOP_RESUME`) and what the next tick decides; the history comes from the caller. A pause names its
stop conditions, the receipt that met them and the roles that may lift it. An authorized actor's signed
resume lifts it (the same receipt then does not pause again), as does a newer judged receipt meeting no
stop condition. Conditions that are not a receipt's (the parent cannot be resolved now) pause every tick.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lightning_dagster.gate.consistency import CLOCK_SKEW_S
from lightning_dagster.release.signing import LOOP_RESUME, ActorKey, Name, Reason, Text, signer, verify

LOOP = "continual_learning"
# Who may lift a pause recorded before pauses named their roles: `GateResource.default_approver_roles`' default.
DEFAULT_RESUME_ROLES = ("default-approver",)


class LoopDecision(BaseModel):
    """`by`: the gate (older pauses: `sensor`), an actor (signed resume) or a newer receipt. A resume names
    its pause by hash; a pause, the roles that may lift it (`resume_roles`; None: recorded before)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    action: Literal["pause", "resume"]
    by: Literal["gate", "sensor", "actor", "receipt"]
    at: float
    loop: str = LOOP
    conditions: list[str] = []
    receipt_id: str | None = None
    pause_hash: str | None = None
    actor: str | None = None
    role: str | None = None
    reason: str = ""
    signature: str | None = None
    resume_roles: list[str] | None = None


def resume_roles_of(pause: LoopDecision) -> list[str]:
    return list(DEFAULT_RESUME_ROLES) if pause.resume_roles is None else list(pause.resume_roles)


class ResumeRequest(BaseModel):
    """What an actor signs to resume, as `loop sign` prints it."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    actor: Name
    role: Name
    reason: Reason
    at: float = Field(gt=0)
    pause_hash: Text
    signature: str = ""


def resume_fields(request: ResumeRequest) -> dict[str, Any]:
    return request.model_dump(exclude={"signature"})


def resume_problem(
    request: ResumeRequest,
    current_pause: str | None,
    actors: Mapping[str, ActorKey],
    allowed_roles: Collection[str],
    *,
    paused_at: float | None = None,
    now: float | None = None,
    clock_skew_s: float = CLOCK_SKEW_S,
) -> str | None:
    """Why `request` may not resume the loop (None: it may); `current_pause`: the pause in force's hash."""
    who = f"resume by {request.actor} as {request.role}"
    if current_pause is None:
        return f"{who}: the loop is not paused"
    if request.pause_hash != current_pause:
        return f"{who}: signs pause {request.pause_hash}, not the pause in force {current_pause}"
    now = time.time() if now is None else now
    if request.at > now + clock_skew_s:
        return f"{who}: signed at {request.at}, ahead of the clock ({now:.0f})"
    if paused_at is not None and request.at < paused_at - clock_skew_s:
        return f"{who}: signed at {request.at}, before the pause it lifts ({paused_at:.0f})"
    if request.role not in allowed_roles:
        return f"{who}: role {request.role!r} may not resume (allowed: {sorted(allowed_roles)})"
    entry = signer(who, actors, request.actor, request.role, request.signature)
    if isinstance(entry, str):
        return entry
    if not verify(entry.public_key, LOOP_RESUME, resume_fields(request), request.signature):
        return f"{who}: signature does not verify with {request.actor}'s key"
    return None


def actor_resume(request: ResumeRequest, paused: LoopDecision) -> LoopDecision:
    # every field of the request: when, which pause, who, in which role, why, and the signature
    return LoopDecision(
        action="resume", by="actor", loop=paused.loop, receipt_id=paused.receipt_id, **request.model_dump()
    )


def next_decision(
    history: Sequence[LoopDecision],
    latest_receipt: str | None,
    receipt_conditions: Sequence[str],
    live_conditions: Sequence[str],
    now: float,
    *,
    resume_roles: Sequence[str] | None = None,
) -> LoopDecision | None:
    """The decision a tick records (None: none). `live_conditions` hold now whatever the receipts say."""
    last = history[-1] if history else None
    if last is not None and last.action == "pause":
        cleared = not receipt_conditions and not live_conditions
        if latest_receipt is not None and latest_receipt != last.receipt_id and cleared:
            return LoopDecision(
                action="resume",
                by="receipt",
                at=now,
                loop=last.loop,
                receipt_id=latest_receipt,
                reason=f"receipt {latest_receipt} meets no stop condition",
            )
        return None
    accepted = {d.receipt_id for d in history if d.action == "resume" and d.by == "actor"}
    conditions = [*live_conditions, *([] if latest_receipt in accepted else receipt_conditions)]
    if not conditions:
        return None
    return LoopDecision(
        action="pause",
        by="gate",
        at=now,
        conditions=conditions,
        receipt_id=latest_receipt,
        resume_roles=None if resume_roles is None else list(resume_roles),
    )
