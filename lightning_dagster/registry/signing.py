"""Approvers' Ed25519 keys and signatures: key pairs, their files, and signed approvals.

A private key is a PKCS#8 PEM file readable by its owner only (written 0600, refused if group or others can
read it); the public key is one line, `ed25519:<base64>`, pasted into the deployment's roles file.
Verification is the gate's (`lightning_dagster.gate.approvals`), so the gate and the registry check one way.
"""

from __future__ import annotations

import base64
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.gate.approvals import PUBLIC_KEY_PREFIX, approval_message, evidence_hash
from lightning_dagster.gate.receipt import Approval, Receipt
from lightning_dagster.registry.errors import KeyFileError
from lightning_dagster.registry.receipts import approval_step

ACTOR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class KeyPair:
    actor: str
    private_path: Path
    public_key: str  # the `ed25519:<base64>` line

    def roles_entry(self, roles: list[str]) -> str:
        """The roles-file lines that authorize this key (YAML)."""
        return f"  {self.actor}:\n    roles: [{', '.join(roles)}]\n    key: {self.public_key}\n"


def public_key_line(key: Ed25519PrivateKey) -> str:
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PUBLIC_KEY_PREFIX + base64.b64encode(raw).decode()


def generate_keypair(actor: str, out_dir: Path | str) -> KeyPair:
    """Write `<actor>.key` (0600, never overwritten) and `<actor>.pub` in `out_dir`."""
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


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return base64.b64encode(key.sign(message)).decode()


def sign_approval(
    receipt: Receipt,
    *,
    actor: str,
    role: str,
    key: Path | str,
    step: str | None = None,
    at: float | None = None,
) -> Approval:
    """`actor`'s approval in `role` of `step` (default: the step the receipt lets that role approve, the
    default step first) over the receipt's evidence as it stands, signed with the private key file `key`."""
    private = load_private_key(key)
    step = step or approval_step(receipt, role)
    at = time.time() if at is None else at
    evidence = evidence_hash(receipt)
    message = approval_message(receipt.receipt_id, evidence, step, actor, role, at)
    return Approval(
        actor=actor, role=role, step=step, at=at, evidence_hash=evidence, signature=sign(private, message)
    )
