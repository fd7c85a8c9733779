"""Moving `approved-default` back: what a rollback signs (`signing.ROLLBACK`), its verification against the
pinned roles, and the move. The signature names the pointer's newest move (`from_seq`): it rolls back once.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_dagster.gate.consistency import CLOCK_SKEW_S
from lightning_dagster.gate.errors import from_validation_error
from lightning_dagster.registry import pointers
from lightning_dagster.registry.approved import serve_once
from lightning_dagster.registry.errors import CheckpointFilesMismatch, WeightsMismatch
from lightning_dagster.registry.receipt_tags import stored_head
from lightning_dagster.release import chain
from lightning_dagster.release.errors import PromotionRefused, RollbackRefused
from lightning_dagster.release.promotion import DEFAULT_APPROVER, PromotionResult
from lightning_dagster.release.roles import registry_roles
from lightning_dagster.release.signing import (
    ROLLBACK,
    ActorKey,
    Name,
    Reason,
    load_private_key,
    sign,
    signer,
    verify,
)

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry


class RollbackRequest(BaseModel):
    """A signed rollback: the fields `registry sign-rollback` prints and the `rollback` job takes."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    target_version: Name
    from_version: Name
    from_seq: int = Field(ge=1)
    actor: Name
    role: Name
    reason: Reason
    at: float = Field(gt=0)
    signature: str = ""


def rollback_request(data: Mapping[str, Any]) -> RollbackRequest:
    """A `RollbackRequest`; a bad field raises the gate's `InvalidInput` naming it."""
    try:
        return RollbackRequest.model_validate(dict(data))
    except ValidationError as err:
        raise from_validation_error("rollback", err) from None


def rollback_fields(pointer: str, request: RollbackRequest) -> dict[str, Any]:
    return {"pointer": pointer, **request.model_dump(exclude={"signature"})}


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
    """Why `request` does not authorize rolling `pointer` back (None: it does): an allowed role the actor
    holds, the newest move (`head`), a time not before it nor ahead of `now`, a valid signature."""
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
    if not verify(entry.public_key, ROLLBACK, rollback_fields(pointer, request), request.signature):
        return f"{who}: signature does not verify with {request.actor}'s key"
    return None


def sign_rollback(
    reg: Registry,
    target_version: str,
    *,
    actor: str,
    key: Path | str,
    reason: str,
    role: str = DEFAULT_APPROVER,
    at: float | None = None,
) -> RollbackRequest:
    """`actor`'s signed rollback of `approved-default` to `target_version`; nothing moves until `rollback`."""
    head = reg.verified().require().head
    if head is None:
        raise RollbackRefused(
            actor, role, f"{reg.pointer_name()} was never set; there is nothing to roll back"
        )
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
    signature = sign(load_private_key(key), ROLLBACK, rollback_fields(reg.pointer_name(), request))
    return request.model_copy(update={"signature": signature})


def rollback_roles(reg: Registry, head: Any) -> list[str]:
    """`default-approver` and the default-step roles of the undone move's receipt (they may take it back)."""
    roles = [DEFAULT_APPROVER]
    if head is not None and head.receipt_id:
        try:
            stored = stored_head(reg.store, head.receipt_id)
        except Exception:  # noqa: BLE001 - an unreadable receipt widens nothing
            return roles
        if stored is not None:
            roles += [r for r in stored.receipt.plan.approvers.default if r not in roles]
    return roles


def rollback(
    reg: Registry, request: RollbackRequest, *, allowed_roles: Collection[str] | None = None
) -> PromotionResult:
    """Move `approved-default` back by an authorized `request`, once the earlier target proves it serves."""
    name = reg.pointer_name()
    history = pointers.reconcile(reg).chain.require().moves  # never built on a history that does not verify
    head = history[-1] if history else None
    if allowed_roles is None:
        allowed_roles = rollback_roles(reg, head)

    def refuse_unless_authorized(head: Any) -> None:
        problem = rollback_problem(request, name, head, registry_roles(reg).actors, allowed_roles)
        if problem is not None:
            raise RollbackRefused(request.actor, request.role, problem)

    refuse_unless_authorized(head)
    to_version = request.target_version
    current = head.to_value if head else None
    if to_version == current:
        raise PromotionRefused(f"version {to_version} is already approved-default")
    if to_version not in {m.to_value for m in history[:-1]}:
        raise PromotionRefused(f"version {to_version} was never approved-default; rollback only goes back")
    target = reg.model_version(to_version)
    approved = {pointers.approved_hash(m) for m in history if m.to_value == to_version}
    if target.weights_hash not in approved:
        raise WeightsMismatch(to_version, ",".join(sorted(h for h in approved if h)), target.weights_hash)
    files = {pointers.approved_hash(m, "files_hash") for m in history if m.to_value == to_version} - {None}
    if files and target.files_hash not in files:
        raise CheckpointFilesMismatch(to_version, ",".join(sorted(files)), target.files_hash or "(none)")
    serve_once(reg.fetch(target))
    # The probe takes seconds: a move made meanwhile (even one back to this value) voids the signature.
    latest = reg.store.pointer_history(name, last=1)
    refuse_unless_authorized(latest[-1] if latest else None)
    move = pointers.move(
        reg,
        expected=current,
        expected_seq=head.seq,  # the move the signature names: any move since refuses this one
        to=to_version,
        actor=request.actor,
        note="rollback",
        # the rollback's own signature is the move's: its fields are the move's (`release.chain`)
        signed=chain.move_note(
            target.weights_hash, target.files_hash, kind=chain.ROLLED_BACK, role=request.role, at=request.at,
            reason=request.reason, signed_at=request.at, from_seq=request.from_seq, signature=request.signature,
        ),
    )  # fmt: skip
    error = pointers.mirror_after_move(reg)
    return PromotionResult(move=move, mirrored=error is None, mirror_error=error)
