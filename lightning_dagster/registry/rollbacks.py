"""What a rollback signs and how it is verified: an authorized actor's Ed25519 signature over the exact
decision (this pointer, from the version it holds at its newest move, to the target, by whom, in which role,
why, when), checked against the roles pinned in the store, as approvals (`gate.approvals`) and resumes
(`gate.pauses`) are.

The signature names the pointer's newest move (`from_seq`), so it rolls back once: after any move of the
pointer (this rollback, a promotion, another rollback) it no longer verifies, and a signature for another
model's pointer or another target never does. `registry sign-rollback` prints a signed request (the
`rollback` job's run config); `registry rollback --key` signs and records in one step.
"""

from __future__ import annotations

import time
import unicodedata
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from lightning_dagster.gate.approvals import ActorKey, signer, verify_signature
from lightning_dagster.gate.consistency import CLOCK_SKEW_S
from lightning_dagster.gate.hashing import canonical_json

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry

MESSAGE_PURPOSE = "lightning-dagster rollback v1"
MAX_REASON_CHARS = 1024
MAX_NAME_CHARS = 128


class RollbackRequest(BaseModel):
    """A signed rollback: the fields `registry sign-rollback` prints and the `rollback` job takes."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    target_version: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    from_version: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    from_seq: int = Field(ge=1)
    actor: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    role: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    reason: str = Field(min_length=1, max_length=MAX_REASON_CHARS)
    at: float = Field(gt=0)
    signature: str = ""

    @field_validator("target_version", "from_version", "actor", "role", "reason")
    @classmethod
    def _printable_text(cls, value: str) -> str:
        """Blank text says nothing; a control character would be stored and printed by `registry history`."""
        if not value.strip():
            raise ValueError("must not be blank")
        if bad := sorted({repr(c) for c in value if unicodedata.category(c) == "Cc"}):
            raise ValueError(f"must not contain control characters ({', '.join(bad)})")
        return value


def rollback_request(data: Mapping[str, Any]) -> RollbackRequest:
    """A rollback's fields as a `RollbackRequest`; a missing, blank, oversized or control-character field
    raises the gate's `InvalidInput` naming it."""
    from lightning_dagster.gate.errors import from_validation_error

    try:
        return RollbackRequest.model_validate(dict(data))
    except ValidationError as err:
        raise from_validation_error("rollback", err) from None


def rollback_message(
    pointer: str,
    from_version: str,
    from_seq: int,
    target_version: str,
    actor: str,
    role: str,
    reason: str,
    at: float,
) -> bytes:
    """The exact bytes a rollback's signature covers (canonical JSON, so signer and verifier agree)."""
    return canonical_json(
        {
            "purpose": MESSAGE_PURPOSE,
            "pointer": pointer,
            "from_version": from_version,
            "from_seq": from_seq,
            "target_version": target_version,
            "actor": actor,
            "role": role,
            "reason": reason,
            "at": at,
        }
    )


def _message(pointer: str, r: RollbackRequest) -> bytes:
    return rollback_message(
        pointer, r.from_version, r.from_seq, r.target_version, r.actor, r.role, r.reason, r.at
    )


def rollback_problem(
    request: RollbackRequest,
    pointer: str,
    head: Any,
    actors: Mapping[str, ActorKey],
    allowed_roles: Collection[str],
    *,
    now: float | None = None,
    clock_skew_s: float = CLOCK_SKEW_S,
) -> str | None:
    """Why `request` does not authorize rolling `pointer` back (None: it does). `head`: the pointer's newest
    move (a `PointerMove`; None: never set). The role must be one of `allowed_roles` and held by the actor
    in the pinned roles (`actors`), the request must name the pointer's newest move and value, its time may
    not precede that move nor lie ahead of `now` (beyond `clock_skew_s`), and the signature must verify
    with the actor's key over exactly these fields."""
    who = f"rollback to {request.target_version} by {request.actor} as {request.role}"
    if request.role not in allowed_roles:
        return f"{who}: moving approved-default back needs one of the roles {sorted(allowed_roles)}"
    entry = signer(who, actors, request.actor, request.role, request.signature)
    if isinstance(entry, str):
        return entry
    if head is None:
        return f"{who}: {pointer} was never set"
    if (request.from_version, request.from_seq) != (head.to_value, head.seq):
        return (
            f"{who}: signs a rollback from version {request.from_version} (move {request.from_seq}); "
            f"{pointer} is version {head.to_value} since move {head.seq}"
        )
    now = time.time() if now is None else now
    if request.at > now + clock_skew_s:
        return f"{who}: signed at {request.at}, ahead of the clock ({now:.0f})"
    if request.at < head.moved_at - clock_skew_s:
        return f"{who}: signed at {request.at}, before the move it undoes ({head.moved_at:.0f})"
    if not verify_signature(entry.public_key, _message(pointer, request), request.signature):
        return f"{who}: signature does not verify with {request.actor}'s key"
    return None


def sign_rollback(
    reg: Registry,
    target_version: str,
    *,
    actor: str,
    role: str,
    key: Path | str,
    reason: str,
    at: float | None = None,
) -> RollbackRequest:
    """`actor`'s rollback of `approved-default` to `target_version` in `role`, from the pointer's newest move
    as it stands, signed with the private key file `key`. Nothing moves; `Registry.rollback` records it."""
    from lightning_dagster.registry.errors import RollbackRefused
    from lightning_dagster.registry.signing import load_private_key, sign

    moves = reg.store.pointer_history(reg.pointer_name(), last=1)
    if not moves:
        raise RollbackRefused(
            actor, role, f"{reg.pointer_name()} was never set; there is nothing to roll back"
        )
    head = moves[-1]
    fields = {
        "target_version": str(target_version),
        "from_version": head.to_value,
        "from_seq": head.seq,
        "actor": actor,
        "role": role,
        "reason": reason,
        "at": time.time() if at is None else at,
    }
    request = rollback_request(fields)  # refuse what could not be recorded before anything is signed
    signature = sign(load_private_key(key), _message(reg.pointer_name(), request))
    return request.model_copy(update={"signature": signature})
