"""What an approval signs and how it is verified: an Ed25519 signature by the actor's key over the receipt's
evidence hash, the step, the actor, the role and the time. Pure: keys come from the caller's trust root.

The evidence hash is the receipt's content hash without its approvals and the gate's record, so approvals
added later do not change what earlier ones signed, while any added or edited evidence does.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from lightning_dagster.gate.hashing import canonical_json, content_hash
from lightning_dagster.gate.receipt_models import Approval, Receipt

PUBLIC_KEY_PREFIX = "ed25519:"
MESSAGE_PURPOSE = "lightning-dagster approval v1"


@dataclass(frozen=True)
class ActorKey:
    """One authorized actor: the roles they hold and their public key (`ed25519:<base64 of 32 bytes>`)."""

    roles: frozenset[str]
    public_key: str


def evidence_hash(receipt: Receipt) -> str:
    return content_hash(receipt.model_dump(mode="json", exclude={"gate", "approvals"}))


def approval_message(receipt_id: str, evidence: str, step: str, actor: str, role: str, at: float) -> bytes:
    """The exact bytes an approval's signature covers (canonical JSON, so signer and verifier agree)."""
    return canonical_json(
        {
            "purpose": MESSAGE_PURPOSE,
            "receipt_id": receipt_id,
            "evidence_hash": evidence,
            "step": step,
            "actor": actor,
            "role": role,
            "at": at,
        }
    )


def parse_public_key(text: str) -> Ed25519PublicKey:
    """`ed25519:<base64>` -> key; anything else raises `ValueError` naming what is wrong."""
    if not isinstance(text, str) or not text.startswith(PUBLIC_KEY_PREFIX):
        raise ValueError(f"public key must start with {PUBLIC_KEY_PREFIX!r}")
    try:
        raw = base64.b64decode(text.removeprefix(PUBLIC_KEY_PREFIX), validate=True)
    except binascii.Error as exc:
        raise ValueError(f"public key is not base64: {exc}") from None
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key has 32 bytes, this one {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def verify_signature(public_key: str, message: bytes, signature: str) -> bool:
    try:
        raw = base64.b64decode(signature, validate=True)
        parse_public_key(public_key).verify(raw, message)
    except (InvalidSignature, ValueError, binascii.Error):
        return False
    return True


def signer(
    who: str, actors: Mapping[str, ActorKey], actor: str, role: str, signature: str | None
) -> ActorKey | str:
    """The deployment's key entry for `actor` signing as `role`, or why it cannot sign (a message opening
    with `who`): not a known approver, not holding the role, or no signature at all."""
    entry = actors.get(actor)
    if entry is None:
        return f"{who}: actor {actor!r} is not among the deployment's approvers"
    if role not in entry.roles:
        return f"{who}: actor {actor!r} does not hold role {role!r}"
    if not signature:
        return f"{who}: not signed"
    return entry


def approval_problem(
    receipt: Receipt, approval: Approval, actors: Mapping[str, ActorKey], accepted: Collection[str]
) -> str | None:
    """Why `approval` proves nothing for `receipt` (None: it is valid). `accepted` holds the evidence
    hashes it may have signed: the receipt's own, or for a canary approval any earlier version's."""
    who = f"approval by {approval.actor} as {approval.role} ({approval.step})"
    allowed = receipt.plan.approvers.default if approval.step == "default" else receipt.plan.approvers.canary
    if approval.role not in allowed:
        return f"{who}: the plan does not let role {approval.role} approve the {approval.step} step"
    entry = signer(who, actors, approval.actor, approval.role, approval.signature)
    if isinstance(entry, str):
        return entry
    if not approval.evidence_hash:
        return f"{who}: not signed"
    if approval.evidence_hash not in accepted:
        return f"{who}: signs evidence {approval.evidence_hash}, not this receipt's"
    message = approval_message(
        receipt.receipt_id, approval.evidence_hash, approval.step, approval.actor, approval.role, approval.at
    )
    if not verify_signature(entry.public_key, message, approval.signature):
        return f"{who}: signature does not verify with {approval.actor}'s key"
    return None


def approval_problems(
    receipt: Receipt, actors: Mapping[str, ActorKey], earlier: Collection[str] = ()
) -> list[str]:
    """Every approval of `receipt` that does not verify. A default-step approval must sign the evidence as
    it stands; a canary approval may sign it or an earlier version's (`earlier`): the canary is approved
    before its own evidence exists."""
    current = evidence_hash(receipt)
    problems = []
    for approval in receipt.approvals:
        accepted = {current} if approval.step == "default" else {current, *earlier}
        if (problem := approval_problem(receipt, approval, actors, accepted)) is not None:
            problems.append(problem)
    return problems
