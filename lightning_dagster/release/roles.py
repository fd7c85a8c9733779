"""Who may approve what, and with which key: the deployment's roles (`actors: {alice: {roles: [...], key:
ed25519:<base64>}}`, keys from `registry keygen`), pinned in the store. The first use pins the configured
roles file (`gate.roles_path`, $LD_ROLES_FILE) unsigned: the configuration vouches for it. Every later change
needs a `ROLES_PIN` signature over the old and new hashes and the pin's move number by the configured
roles-admin key (`gate.roles_admin_key`), never a key the store holds. Every read verifies the pin's whole
history; a configured roles file that is not the verified pin is a `RolesConfigError` naming both hashes. A
roles file in the learner's write surface is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_dagster import paths
from lightning_dagster.canonical import content_hash
from lightning_dagster.registry.errors import ChainBroken
from lightning_dagster.registry.pointers import move_note
from lightning_dagster.release.errors import NotAuthorized, RolesConfigError
from lightning_dagster.release.signing import ROLES_PIN, ActorKey, parse_public_key, verify
from lightning_dagster.settings import GateSettings
from lightning_dagster.store.errors import Conflict

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry

PIN = "approval-roles"
COLLECTION = "approval_roles"
ROLES_ADMIN = "roles-admin"
DEPLOYMENT = "deployment"  # the actor recorded for the first pin, which the configuration vouches for
NOT_CONFIGURED = (
    "no roles are configured to authorize against: set gate.roles_path ($LD_ROLES_FILE) to the deployment's "
    "roles file, and gate.roles_admin_key ($LD_ROLES_ADMIN_KEY) to the roles-admin's public key"
)


@dataclass(frozen=True)
class Roles:
    actors: dict[str, ActorKey]
    digest: str  # content hash of the actors table: what the store pins
    source: str  # the file it was read from, as recorded

    def require(self, actor: str, role: str) -> None:
        """Raise `NotAuthorized` unless `actor` holds `role` in these roles."""
        entry = self.actors.get(actor)
        if entry is None or role not in entry.roles:
            held = f"{actor!r} does not hold role {role!r}"
            raise NotAuthorized(
                actor, role, f"{held} in the deployment's roles {self.digest[:19]} ({self.source})"
            )

    def table(self) -> dict[str, Any]:
        return {a: {"roles": sorted(k.roles), "key": k.public_key} for a, k in sorted(self.actors.items())}


def parse_roles(data: Any, source: str) -> Roles:
    """Validate the `actors:` mapping; every problem is a `RolesConfigError` naming the actor and field."""
    actors = data.get("actors") if isinstance(data, dict) else None
    if not isinstance(actors, dict):
        raise RolesConfigError(f"roles {source}: expected a mapping `actors: {{name: {{roles, key}}}}`")
    parsed: dict[str, ActorKey] = {}
    for actor, entry in actors.items():
        where = f"roles {source}: actors.{actor}"
        if not isinstance(entry, dict) or set(entry) != {"roles", "key"}:
            raise RolesConfigError(f"{where} must be a mapping with exactly `roles` and `key`")
        roles = entry["roles"]
        if not isinstance(roles, list) or not all(isinstance(r, str) and r for r in roles):
            raise RolesConfigError(f"{where}.roles must be a list of role names")
        try:
            parse_public_key(entry["key"])
        except ValueError as exc:
            raise RolesConfigError(f"{where}.key: {exc}") from None
        parsed[str(actor)] = ActorKey(frozenset(roles), entry["key"])
    table = {a: {"roles": sorted(k.roles), "key": k.public_key} for a, k in sorted(parsed.items())}
    return Roles(parsed, content_hash(table), source)


def read_roles_file(path: Path | str) -> Roles:
    path = Path(path).resolve()
    # the trainer writes there: a roles file inside could grant itself approval
    for surface in (paths.models_dir(), paths.mlflow_artifact_root()):
        if path.is_relative_to(surface.resolve()):
            raise RolesConfigError(f"roles file {path} lies inside the learner's write surface {surface}")
    if not path.is_file():
        raise RolesConfigError(f"roles file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RolesConfigError(f"roles file {path} is not valid YAML: {exc}") from None
    return parse_roles(data, str(path))


def _document(store: Any, digest: str) -> Roles:
    """The pinned roles document `digest`, which must hash to it (`RolesConfigError` otherwise)."""
    versions = store.document_versions(COLLECTION, digest)
    if not versions:
        raise RolesConfigError(f"the store pins roles {digest} but holds no such document")
    body = versions[-1].body
    roles = parse_roles(body, str(body.get("source", "store")))
    if roles.digest != digest:
        raise RolesConfigError(f"the pinned roles document hashes to {roles.digest}, not its pin {digest}")
    return roles


def pin_fields(previous: str | None, new: str, *, pin_seq: int) -> dict[str, Any]:
    """What the roles-admin signs to move the pin; its move number keeps the signature from being replayed."""
    return {"from": previous, "to": new, "pin_seq": pin_seq}


def pin_state(store: Any) -> tuple[str | None, int]:
    """The pinned roles' hash and the pin's newest move number ((None, 0): never pinned)."""
    return store.pointer_state(PIN)


def configured_roles(gate: GateSettings) -> Roles | None:
    return read_roles_file(gate.roles_path) if gate.roles_path else None


@dataclass(frozen=True)
class PinChain:
    """Every vouched-for roles version, oldest first, and the first bad pin record (None: all verify)."""

    versions: list[Roles]
    problem: str | None
    configured: Roles | None

    def require(self) -> None:
        if self.problem is not None:
            raise ChainBroken(PIN, self.problem, self.versions[-1].digest if self.versions else None)


def verify_pin(store: Any, gate: GateSettings, *, match_configured: bool = True) -> PinChain:
    """Verify the pin's whole history: contiguous moves, documents hashing to their pins, changes signed by
    `gate.roles_admin_key`, an unsigned first pin only if configured or vouched for by the next change.
    `RolesConfigError`: a configured file that is not the pin (`match_configured`), or nothing configured."""
    configured, admin = configured_roles(gate), gate.roles_admin_key.strip() or None
    moves, row = store.pointer_history(PIN), store.pointer_state(PIN)
    if not moves and row == (None, 0):
        return PinChain([], None, configured)
    if configured is None and admin is None:
        raise RolesConfigError(NOT_CONFIGURED)
    versions: list[Roles] = []
    problem, unvouched = None, False
    for i, m in enumerate(moves, 1):
        where = f"roles pin move {m.seq} ({m.from_value or '(none)'} -> {m.to_value})"
        signature = move_note(m).get("signature")  # {} for a pin made before pins were signed
        if m.seq != i:
            problem = f"{where}: expected move {i} (a pin move was inserted, deleted or reordered)"
        elif m.from_value != (versions[-1].digest if versions else None):
            problem = f"{where}: does not start where move {i - 1} ended"
        elif signature and not (
            admin and verify(admin, ROLES_PIN, pin_fields(m.from_value, m.to_value, pin_seq=i - 1), signature)
        ):
            problem = f"{where}: its signature is not the configured roles-admin key's"
        elif not signature and i > 1:
            problem = f"{where}: not signed by the configured roles-admin key"
        if problem is None:
            try:
                versions.append(_document(store, m.to_value))
            except RolesConfigError as exc:
                problem = f"{where}: {exc}"
        if problem is not None:
            break
        # an unsigned first pin that is not the configured file stands only if the admin's move 2 signs from it
        unvouched = (
            unvouched or i == 1 and not signature and not (configured and configured.digest == m.to_value)
        )
    if problem is None and moves and row != (moves[-1].to_value, moves[-1].seq):
        problem = f"roles pin row: says {row[0]} (move {row[1]}), its history ends at move {moves[-1].seq}"
    elif problem is None and not moves:
        problem = f"roles pin row: says {row[0]} (move {row[1]}) with no move in its history"
    pinned = versions[-1] if versions else None
    if unvouched and len(versions) < 2 and configured is None:
        problem = (
            problem or f"roles pin move 1 ({moves[0].to_value}): unsigned, and no roles file vouches for it"
        )
        versions = []
    elif (
        match_configured and problem is None and configured and pinned and pinned.digest != configured.digest
    ):
        raise RolesConfigError(
            f"roles file {configured.source} ({configured.digest}) is not the deployment's pinned roles "
            f"({pinned.digest}, from {pinned.source}); pin it with a signed change "
            "(`lightning-dagster registry roles --pin FILE --key ROLES_ADMIN_KEY`) or configure the pinned file"
        )
    return PinChain(versions, problem, configured)


def pinned_roles(store: Any, gate: GateSettings, *, match_configured: bool = True) -> Roles | None:
    """The verified pinned roles (None: never pinned); `ChainBroken` when the pin does not verify."""
    chain = verify_pin(store, gate, match_configured=match_configured)
    chain.require()
    return chain.versions[-1] if chain.versions else None


def pin_roles(store: Any, roles: Roles, gate: GateSettings, *, signature: str | None = None) -> Roles:
    """Pin `roles`: unsigned only as the configured file's first pin, else signed by the roles-admin key."""
    _, pin_seq = pin_state(store)  # read before the roles: a pin moved in between fails the move below
    current = pinned_roles(store, gate, match_configured=False)
    if current is not None and current.digest == roles.digest:
        return current
    configured = configured_roles(gate)
    unsigned_ok = current is None and configured is not None and configured.digest == roles.digest
    fields = pin_fields(current.digest if current else None, roles.digest, pin_seq=pin_seq)
    admin = gate.roles_admin_key.strip()
    if not unsigned_ok and not (signature and admin and verify(admin, ROLES_PIN, fields, signature)):
        raise NotAuthorized(
            ROLES_ADMIN,
            ROLES_ADMIN,
            f"the new roles {roles.digest} are not signed by the configured {ROLES_ADMIN} key "
            f"(gate.roles_admin_key, $LD_ROLES_ADMIN_KEY) over the pin as it stands (move {pin_seq}, a "
            f"{ROLES_PIN} signature; a signature over an earlier pin state does not verify)",
        )
    try:
        if not store.document_versions(COLLECTION, roles.digest):
            body = {"actors": roles.table(), "source": roles.source}
            store.append_document(COLLECTION, roles.digest, roles.digest, body, None)
        store.move_pointer(
            PIN,
            expected=current.digest if current else None,
            expected_seq=pin_seq,
            to=roles.digest,
            actor=DEPLOYMENT if unsigned_ok else ROLES_ADMIN,
            note=json.dumps({"source": roles.source, "signature": None if unsigned_ok else signature}),
        )
    except Conflict:  # PointerConflict too: another process pinned first; its pin stands if it is ours
        if store.current_pointer(PIN) != roles.digest:
            raise
    return roles


def deployment_roles(
    store: Any, configured: Path | str | None = None, *, gate: GateSettings | None = None
) -> Roles:
    """The verified pin (pinning the configured file if nothing is); `RolesConfigError`, `ChainBroken`."""
    gate = gate or GateSettings(roles_path=str(configured or ""))
    chain = verify_pin(store, gate)
    chain.require()
    if chain.versions:
        return chain.versions[-1]
    if chain.configured is None:
        raise RolesConfigError(NOT_CONFIGURED)
    return pin_roles(store, chain.configured, gate)


def registry_roles(reg: Registry) -> Roles:
    return deployment_roles(reg.store, gate=reg.gate)
