"""Who may approve what, and with which key: the deployment's roles, pinned in the store.

```yaml
actors:
  alice:
    roles: [default-approver, release-owner]
    key: ed25519:<base64>    # from `lightning-dagster registry keygen --actor alice --out DIR`
```
The first use against a store pins the deployment's roles file (hash and body: pointer `approval-roles`,
documents `approval_roles`); from then on only the pinned roles authorize, and a roles file given later is
accepted only if it hashes to the pin, so a file a caller writes authorizes no one. Changing the pin needs a
`signing.ROLES_PIN` signature over the old and new hashes and the pin's move number (`pin_seq`, so it is
good for one change) by a `roles-admin` of the pinned roles. A roles file inside the learner's write
surface (the models directory, the MLflow artifact root) is refused before anything is pinned.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lightning_dagster import paths
from lightning_dagster.canonical import content_hash
from lightning_dagster.release.errors import NotAuthorized, RolesConfigError
from lightning_dagster.release.signing import ROLES_PIN, ActorKey, parse_public_key, verify
from lightning_dagster.store.errors import Conflict

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry

PIN = "approval-roles"
COLLECTION = "approval_roles"
ROLES_ADMIN = "roles-admin"
DEPLOYMENT = "deployment"  # the actor recorded for the first pin, which no one signs


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


def pinned_roles(store: Any) -> Roles | None:
    """The roles the store pins, None if the deployment never pinned any."""
    digest = store.current_pointer(PIN)
    if digest is None:
        return None
    versions = store.document_versions(COLLECTION, digest)
    if not versions:
        raise RolesConfigError(f"the store pins roles {digest} but holds no such document")
    body = versions[-1].body
    roles = parse_roles(body, body.get("source", "store"))
    if roles.digest != digest:
        raise RolesConfigError(f"the pinned roles document hashes to {roles.digest}, not its pin {digest}")
    return roles


def pin_fields(previous: str | None, new: str, *, pin_seq: int) -> dict[str, Any]:
    """What a roles-admin signs (`signing.ROLES_PIN`) to change the pin from `previous` to `new`: both hashes
    and the pin's move number, so the signature cannot be replayed after the pin moved."""
    return {"from": previous, "to": new, "pin_seq": pin_seq}


def pin_state(store: Any) -> tuple[str | None, int]:
    """The pinned roles' hash and the pin's newest move number ((None, 0): never pinned)."""
    return store.pointer_state(PIN)


def pin_roles(store: Any, roles: Roles, *, actor: str = DEPLOYMENT, signature: str | None = None) -> Roles:
    """Pin `roles` in the store. The first pin needs no signature; replacing one needs `signature` (see
    `pin_fields`) by `actor` holding `roles-admin` in the pinned roles. Pinning the same roles is a no-op."""
    _, pin_seq = pin_state(store)  # read before the roles: a pin moved in between fails the move below
    current = pinned_roles(store)
    if current is not None and current.digest == roles.digest:
        return current
    if current is not None:
        current.require(actor, ROLES_ADMIN)
        fields = pin_fields(current.digest, roles.digest, pin_seq=pin_seq)
        if not signature or not verify(current.actors[actor].public_key, ROLES_PIN, fields, signature):
            raise NotAuthorized(
                actor,
                ROLES_ADMIN,
                f"the new roles are not signed by {ROLES_ADMIN} {actor!r} over the pin as it stands (move "
                f"{pin_seq}, a {ROLES_PIN} signature; a signature over an earlier pin state does not verify)",
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
            actor=actor,
            note=roles.source,
        )
    except Conflict:  # PointerConflict too: another process pinned first; its pin stands if it is ours
        if store.current_pointer(PIN) != roles.digest:
            raise
    return roles


def deployment_roles(store: Any, configured: Path | str | None = None) -> Roles:
    """The roles that authorize on this store: the pin (`configured` is pinned if there is none yet)."""
    if configured is None:
        pinned = pinned_roles(store)
        if pinned is None:
            raise RolesConfigError(
                "no approver roles are pinned in this store: run `lightning-dagster registry roles pin FILE` "
                "once at deployment (or configure the code location's roles file)"
            )
        return pinned
    roles = read_roles_file(configured)
    pinned = pinned_roles(store)
    if pinned is None:
        return pin_roles(store, roles)
    if pinned.digest != roles.digest:
        raise RolesConfigError(
            f"roles file {roles.source} ({roles.digest[:19]}) is not the deployment's pinned roles "
            f"({pinned.digest[:19]}, from {pinned.source}); a roles-admin must sign a change of roles"
        )
    return pinned


def registry_roles(reg: Registry) -> Roles:
    """The roles that authorize moves of `reg`'s pointer (`deployment_roles` of its store)."""
    return deployment_roles(reg.store, reg.roles_file)
