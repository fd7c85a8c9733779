"""A pointer's history verified on every read, from its first move to its head, against the deployment's
configured anchors (the pipeline's public key; the roles pin, verified against the configured roles-admin key
and roles file), never a key the store holds. Kinds of move (its note's `kind`):
- `bootstrap`, move 1 only: a `POINTER_MOVE` signature by the pipeline's key (`release.pipeline_key`).
- `promotion`: a `POINTER_MOVE` signature by an actor of the verified roles, in `default-approver` or a role
  the promoted receipt's version (bound by its hash) names for its default step.
- `rollback`: the actor's `ROLLBACK` signature, in such a role of the undone move's receipt; the target a
  value an earlier verified move approved, with its weights.
- `anchor`: a `POINTER_MOVE` signature by the roles-admin key: moves up to the newest one are vouched for.
Anything else (unsigned: made before moves were signed), a gap or repeat in the move numbers, a move not
starting where the previous ended, or a pointer row that is not the last move breaks the chain there: the
break is recorded once as a pointer incident, and the pointer reads as its last verified move."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from lightning_dagster.gate.ledger import COLLECTION as RECEIPTS
from lightning_dagster.gate.ledger import version_hash
from lightning_dagster.registry import incidents, pointers
from lightning_dagster.registry.errors import ChainBroken
from lightning_dagster.release.errors import KeyFileError, RolesConfigError
from lightning_dagster.release.pipeline_key import public_key, signing_key
from lightning_dagster.release.roles import NOT_CONFIGURED, ROLES_ADMIN, Roles, verify_pin
from lightning_dagster.release.signing import (
    POINTER_MOVE,
    ROLLBACK,
    load_private_key,
    public_key_line,
    sign,
    verify,
)
from lightning_dagster.store.records import PointerMove

if TYPE_CHECKING:
    from pathlib import Path

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from lightning_dagster.registry.core import Registry
    from lightning_dagster.settings import GateSettings

BOOTSTRAP, PROMOTION, ROLLED_BACK, ANCHOR = "bootstrap", "promotion", "rollback", "anchor"
PIPELINE_ROLE = "pipeline"  # the role a bootstrap move names: the pipeline's key signs it
DEFAULT_APPROVER = "default-approver"


@dataclass(frozen=True)
class Chain:
    """A pointer's history as verified: `moves` the verified prefix, `problem` the first bad record."""

    pointer: str
    moves: list[PointerMove]
    history: list[PointerMove]
    row: tuple[str | None, int]  # the `pointers` row as read: (value, seq)
    problem: str | None = None
    incident: Any = None  # the `PointerIncident` recording the break
    versions: list[Roles] = field(default_factory=list)  # every verified roles version, oldest first
    since: int = 0  # the roles version the head verified under
    vouched: int = 0  # how many moves (up to and with the newest valid anchor) are vouched for, not verified

    def check_next(self, store: Any, m: PointerMove, gate: GateSettings) -> str | None:
        """Why `m` would not verify as the move after this chain's head (None: it would)."""
        return check_move(store, m, self.moves, self.versions, self.since, gate)[0]

    @property
    def head(self) -> PointerMove | None:
        return self.moves[-1] if self.moves else None

    @property
    def value(self) -> str | None:
        return self.head.to_value if self.head else None

    def require(self) -> Chain:
        if self.problem is not None:
            raise ChainBroken(self.pointer, self.problem, self.value)
        return self


def signed_fields(
    pointer: str,
    seq: int,
    from_value: str | None,
    to_value: str,
    actor: str,
    receipt_id: str | None,
    note: Mapping,
) -> dict[str, Any]:
    """What a `POINTER_MOVE` signature binds, from a move's columns and its note."""
    return {
        "pointer": pointer, "seq": seq, "from": from_value, "to": to_value,
        "weights_hash": note.get("weights_hash"), "files_hash": note.get("files_hash") or None,
        "receipt_id": receipt_id, "receipt_hash": note.get("receipt_hash"),
        "actor": actor, "role": note.get("role"), "at": note.get("at"),
    }  # fmt: skip


def sign_move(key: Ed25519PrivateKey, pointer: str, seq: int, from_value: str | None, to_value: str,
              actor: str, receipt_id: str | None, note: Mapping) -> str:  # fmt: skip
    return sign(key, POINTER_MOVE, signed_fields(pointer, seq, from_value, to_value, actor, receipt_id, note))


def _default_roles(store: Any, move: PointerMove | None) -> set[str]:
    """The default-step roles of the receipt version `move` records (its body must hash to that)."""
    receipt_hash = pointers.move_note(move).get("receipt_hash") if move else None
    for doc in store.document_versions(RECEIPTS, move.receipt_id) if receipt_hash and move.receipt_id else []:
        if doc.content_hash == receipt_hash and version_hash(doc.body, doc.previous_hash) == receipt_hash:
            try:
                return {str(r) for r in doc.body["plan"]["approvers"]["default"]}
            except (KeyError, TypeError):  # not a receipt's shape: it names no role
                return set()
    return set()


def check_move(store: Any, m: PointerMove, verified: list[PointerMove], versions: list[Roles], since: int,
               gate: GateSettings) -> tuple[str | None, int]:  # fmt: skip
    """Why `m` does not verify after `verified` (None: it does), and the roles version it verified under."""
    prev, note = (verified[-1] if verified else None), pointers.move_note(m)
    where = f"move {m.seq} ({m.from_value or '(unset)'} -> {m.to_value} by {m.actor})"
    if m.seq != (expected := (prev.seq if prev else 0) + 1):
        return f"{where}: expected move {expected} (a move was inserted, deleted or reordered)", since
    if m.from_value != (prev.to_value if prev else None):
        ended = prev.to_value if prev else "(unset)"
        return f"{where}: does not start where move {m.seq - 1} ended ({ended})", since
    kind, signature, role = note.get("kind"), note.get("signature"), note.get("role")
    if not signature or kind not in (BOOTSTRAP, PROMOTION, ROLLED_BACK):
        why = "unsigned or of no known kind (made before moves were signed, or not by the registry)"
        return f"{where}: {why}", since
    fields = signed_fields(m.name, m.seq, m.from_value, m.to_value, m.actor, m.receipt_id, note)
    if kind == BOOTSTRAP:
        key = public_key(gate)
        if key is None:
            raise KeyFileError(
                "no pipeline key is configured to verify the bootstrap move against: set gate.pipeline_public_key "
                "($LD_PIPELINE_PUBLIC_KEY) or gate.pipeline_key_path ($LD_PIPELINE_KEY)"
            )
        good = m.seq == 1 and role == PIPELINE_ROLE and verify(key, POINTER_MOVE, fields, signature)
        return (None if good else f"{where}: not a bootstrap signed by the configured pipeline key"), since
    # a promotion's receipt names its roles; a rollback's, the receipt of the move it undoes
    allowed = {DEFAULT_APPROVER} | _default_roles(store, m if kind == PROMOTION else prev)
    purpose = POINTER_MOVE
    if kind == ROLLED_BACK:
        purpose, fields = ROLLBACK, {
            "pointer": m.name, "from_version": m.from_value, "from_seq": m.seq - 1, "target_version": m.to_value,
            "actor": m.actor, "role": role, "reason": note.get("reason"), "at": note.get("signed_at"),
        }  # fmt: skip
        earlier = {pointers.approved_hash(v) for v in verified[:-1] if v.to_value == m.to_value}
        if pointers.approved_hash(m) not in earlier:
            return (
                f"{where}: rolls back to {m.to_value} with weights no earlier verified move approved",
                since,
            )
    if not isinstance(role, str) or role not in allowed:
        return f"{where}: role {role!r} may not move {m.name} (allowed: {', '.join(sorted(allowed))})", since
    for i in range(since, len(versions)):
        entry = versions[i].actors.get(m.actor)
        if entry and role in entry.roles and verify(entry.public_key, purpose, fields, signature):
            return None, i
    return f"{where}: not signed by {m.actor!r} holding {role!r} in the verified roles", since


def _anchored(history: list[PointerMove], gate: GateSettings) -> int:
    """How many moves the newest anchor signed by the configured roles-admin key ends (0: none)."""
    admin = gate.roles_admin_key.strip()
    for k in range(len(history) - 1, -1, -1) if admin else ():
        m, note = history[k], pointers.move_note(history[k])
        fields = signed_fields(m.name, m.seq, m.from_value, m.to_value, m.actor, m.receipt_id, note)
        if note.get("kind") == ANCHOR and note.get("role") == ROLES_ADMIN:
            if verify(admin, POINTER_MOVE, fields, str(note.get("signature") or "")):
                return k + 1
    return 0


def anchor(reg: Registry, version: str, key: Path | str) -> PointerMove:
    """Move `approved-default` to `version` by the roles-admin's signed anchor, vouching for the history."""
    private = load_private_key(key)
    if public_key_line(private) != reg.gate.roles_admin_key.strip():
        raise KeyFileError(
            f"{key} is not the configured roles-admin key (gate.roles_admin_key, $LD_ROLES_ADMIN_KEY)"
        )
    value, seq = reg.store.pointer_state(reg.pointer_name())
    target = reg.model_version(version)
    note = move_note(target.weights_hash, target.files_hash, kind=ANCHOR, role=ROLES_ADMIN, at=time.time())
    note["signature"] = sign_move(
        private, reg.pointer_name(), seq + 1, value, target.version, ROLES_ADMIN, None, note
    )
    move = pointers.move(reg, expected=value, expected_seq=seq, to=target.version, actor=ROLES_ADMIN, signed=note,
                         note="re-anchored by the roles-admin")  # fmt: skip
    pointers.mirror_after_move(reg)
    return move


def verify_chain(store: Any, pointer: str, gate: GateSettings) -> Chain:
    pin = verify_pin(store, gate)
    versions = pin.versions if pin.versions or pin.problem else [pin.configured] if pin.configured else []
    history, row = store.pointer_history(pointer), store.pointer_state(pointer)
    vouched = _anchored(history, gate)
    verified = history[:vouched]  # the roles-admin vouches for the moves up to its anchor
    if not versions and pin.problem is None and len(history) > len(verified) + 1:
        raise RolesConfigError(NOT_CONFIGURED)  # moves after the bootstrap, and no roles to verify them
    problem, since = None, 0
    for m in history[len(verified) :]:
        problem, since = check_move(store, m, verified, versions, since, gate)
        if problem is not None:
            break
        verified.append(m)
    head = (verified[-1].to_value, verified[-1].seq) if verified else (None, 0)
    if problem is None and row != head:
        problem = (
            f"pointer row: says {row[0] or '(unset)'} (move {row[1]}), its history ends at move {head[1]}"
        )
    if pin.problem is not None:
        problem = pin.problem + (f"; then {problem}" if problem else "")
    return Chain(pointer, verified, history, row, problem, versions=versions, since=since, vouched=vouched)


def verified(reg: Registry) -> Chain:
    """`reg`'s `approved-default` chain verified; a break is recorded once as a pointer incident."""
    chain = verify_chain(reg.store, reg.pointer_name(), reg.gate)
    if chain.problem is None:
        return chain
    known = [i for i in incidents.incidents(reg.store, chain.pointer) if i.chain]
    if known and known[-1].chain == chain.problem:
        return replace(chain, incident=known[-1])
    incident = incidents.record(
        reg.store,
        incidents.PointerIncident(
            pointer=chain.pointer, model=reg.model_name, alias=pointers.APPROVED, found_version=chain.row[0],
            store_version=chain.value, store_seq=chain.head.seq if chain.head else None, detected_at=time.time(),
            not_before=None, restored=False, error="serving refuses until the chain verifies",
            moved_by="unknown (not a verified signature)", moved_by_source="the store's pointer history",
            tampered=True, chain=chain.problem,
        ),
    )  # fmt: skip
    return replace(chain, incident=incident)


def move_note(weights_hash: str, files_hash: str | None, *, kind: str, role: str, at: float, **extra) -> dict:
    """A signed move's note fields (`pointers.move` adds the model and its own note)."""
    return {"weights_hash": weights_hash, "files_hash": files_hash or None, "kind": kind, "role": role, "at": at,
            **extra}  # fmt: skip


def pipeline_signer(gate: GateSettings) -> Ed25519PrivateKey:
    """The pipeline's key, which signs the bootstrap move; `KeyFileError` when none is configured."""
    key = signing_key(gate)
    if key is None:
        raise KeyFileError(
            "the bootstrap move is signed with the pipeline's key: set gate.pipeline_key_path ($LD_PIPELINE_KEY)"
        )
    return key


def bootstrap_note(reg: Registry, version: Any, key: Ed25519PrivateKey, actor: str) -> dict[str, Any]:
    note = move_note(
        version.weights_hash, version.files_hash, kind=BOOTSTRAP, role=PIPELINE_ROLE, at=time.time()
    )
    note["signature"] = sign_move(key, reg.pointer_name(), 1, None, version.version, actor, None, note)
    return note
