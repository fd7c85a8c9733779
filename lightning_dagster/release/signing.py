"""The one signed-message format, Ed25519 signatures over it, and the actors' keys. Every authorization
decision and the pipeline's receipt attestations sign `signed_message(purpose, fields)`, canonical JSON naming
the purpose, so a signature of one kind never verifies as another; `PURPOSES` fixes the fields each binds.
A private key is a PKCS#8 PEM file readable by its owner only; a public key is one line, `ed25519:<base64>`.
Imports nothing of the gate or the registry: the gate's check 7 verifies approvals through this module.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import AfterValidator, Field

from lightning_dagster.canonical import canonical_json

FORMAT = "lightning-dagster signed message"
VERSION = 1  # a verifier accepts this version only: bump it to change what any kind's bytes are

APPROVAL = "approval"
LOOP_RESUME = "loop-resume"
ROLLBACK = "rollback"
ROLES_PIN = "roles-pin"
POINTER_MOVE = "pointer-move"
RECEIPT_ATTESTATION = "receipt-attestation"
# purpose -> the fields its signature binds, every one required. Weakening a kind means editing this table.
PURPOSES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        APPROVAL: frozenset({"receipt_id", "evidence_hash", "step", "actor", "role", "at"}),
        # the one recorded pause it lifts (its hash in the loop's history)
        LOOP_RESUME: frozenset({"pause_hash", "actor", "role", "reason", "at"}),
        ROLLBACK: frozenset(
            {"pointer", "from_version", "from_seq", "target_version", "actor", "role", "reason", "at"}
        ),
        ROLES_PIN: frozenset({"from", "to", "pin_seq"}),
        # the receipt version that justifies the move (None for the bootstrap), by its ledger hash
        POINTER_MOVE: frozenset(
            {"pointer", "seq", "from", "to", "weights_hash", "files_hash", "receipt_id", "receipt_hash"}
            | {"actor", "role", "at"}
        ),
        # the ledger hash covers body and link: every field of the evidence, approvals and verdict
        RECEIPT_ATTESTATION: frozenset({"receipt_id", "version", "content_hash", "previous_hash", "at"}),
    }
)


def printable(value: str) -> str:
    """No blank text, and no control character (NUL, terminal escape, newline) stored and printed as it is."""
    if not value.strip():
        raise ValueError("must not be blank")
    if bad := sorted({repr(c) for c in value if unicodedata.category(c) == "Cc"}):
        raise ValueError(f"must not contain control characters ({', '.join(bad)})")
    return value


Text = Annotated[str, Field(min_length=1), AfterValidator(printable)]
Name = Annotated[Text, Field(max_length=128)]  # an actor's, role's or version's name (as `keygen` allows)
Reason = Annotated[Text, Field(max_length=1024)]  # a sentence for the history, not a document

PUBLIC_KEY_PREFIX = "ed25519:"
ACTOR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _check_fields(purpose: str, fields: Mapping[str, Any]) -> None:
    """`ValueError` for a purpose or fields `PURPOSES` does not name (a caller's mistake)."""
    expected = PURPOSES.get(purpose)
    if expected is None:
        raise ValueError(f"unknown signed-message purpose {purpose!r} (known: {sorted(PURPOSES)})")
    if set(fields) != expected:
        missing, extra = sorted(expected - set(fields)), sorted(set(fields) - expected)
        raise ValueError(f"a {purpose} signs exactly {sorted(expected)} (missing {missing}, extra {extra})")


def signed_message(purpose: str, fields: Mapping[str, Any]) -> bytes:
    _check_fields(purpose, fields)
    return canonical_json({"format": FORMAT, "version": VERSION, "purpose": purpose, "fields": dict(fields)})


def sign(key: Ed25519PrivateKey, purpose: str, fields: Mapping[str, Any]) -> str:
    return base64.b64encode(key.sign(signed_message(purpose, fields))).decode()


def verify(public_key: str, purpose: str, fields: Mapping[str, Any], signature: str) -> bool:
    """Whether `signature` is `public_key`'s over `fields` (malformed: False)."""
    _check_fields(purpose, fields)
    try:  # a stored value no canonical JSON can hold (a NaN, a non-text key) signs nothing
        message = signed_message(purpose, fields)
        raw = base64.b64decode(signature, validate=True)
        parse_public_key(public_key).verify(raw, message)
    except (InvalidSignature, ValueError, TypeError, binascii.Error):
        return False
    return True


@dataclass(frozen=True)
class ActorKey:
    roles: frozenset[str]
    public_key: str


def parse_public_key(text: str) -> Ed25519PublicKey:
    if not isinstance(text, str) or not text.startswith(PUBLIC_KEY_PREFIX):
        raise ValueError(f"public key must start with {PUBLIC_KEY_PREFIX!r}")
    try:
        raw = base64.b64decode(text.removeprefix(PUBLIC_KEY_PREFIX), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"public key is not base64: {exc}") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, this one {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def public_key_line(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PUBLIC_KEY_PREFIX + base64.b64encode(raw).decode()


def signer(
    who: str, actors: Mapping[str, ActorKey], actor: str, role: str, signature: str | None
) -> ActorKey | str:
    """The key entry for `actor` signing as `role`, or why it cannot (a message opening with `who`)."""
    entry = actors.get(actor)
    if entry is None:
        return f"{who}: actor {actor!r} is not among the deployment's approvers"
    if role not in entry.roles:
        return f"{who}: actor {actor!r} does not hold role {role!r}"
    if not signature:
        return f"{who}: not signed"
    return entry


@dataclass(frozen=True)
class KeyPair:
    actor: str
    private_path: Path
    public_key: str  # the `ed25519:<base64>` line

    def roles_entry(self, roles: list[str]) -> str:
        return f"  {self.actor}:\n    roles: [{', '.join(roles)}]\n    key: {self.public_key}\n"


def generate_keypair(actor: str, out_dir: Path | str) -> KeyPair:
    """Write `<actor>.key` (0600, never overwritten) and `<actor>.pub` in `out_dir`."""
    # Imported here: the errors subclass the registry's, whose package loads the gate, which imports this.
    from lightning_dagster.release.errors import KeyFileError

    if not ACTOR_NAME.match(actor):
        raise KeyFileError(f"actor name {actor!r}: letters, digits, '.', '_' or '-', up to 128")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    private_path = out / f"{actor}.key"
    try:
        # O_EXCL: an existing key (perhaps already trusted by a deployment) is never replaced.
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise KeyFileError(f"{private_path} exists; a key is never overwritten") from None
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    line = public_key_line(key)
    (out / f"{actor}.pub").write_text(line + "\n")
    return KeyPair(actor, private_path.resolve(), line)


def load_private_key(path: Path | str) -> Ed25519PrivateKey:
    from lightning_dagster.release.errors import KeyFileError  # see generate_keypair

    path = Path(path)
    try:
        if path.stat().st_mode & 0o077:
            raise KeyFileError(f"private key {path} is readable by others: chmod 600 it")
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except OSError as exc:
        raise KeyFileError(f"cannot read private key {path}: {exc.strerror}") from None
    except (ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key
