"""Approvals on the gate's receipt ledger: a receipt's verified head (ingesting one the ledger lacks once its
approvals verify), signing an approval over the evidence as it stands, and recording verified approvals.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.canonical import content_hash
from lightning_dagster.gate import ReceiptLedger, parse_receipt
from lightning_dagster.gate.ledger import RECEIPT_SNAPSHOTS
from lightning_dagster.gate.receipt import Approval, Receipt, add_approval
from lightning_dagster.registry import receipt_tags
from lightning_dagster.registry.errors import RegistryError
from lightning_dagster.registry.receipt_tags import StoredReceipt, stored_head
from lightning_dagster.release.approvals import approval_fields, approval_problems, evidence_hash
from lightning_dagster.release.errors import ApprovalRefused, NotAuthorized, PromotionRefused
from lightning_dagster.release.roles import Roles, registry_roles
from lightning_dagster.release.signing import APPROVAL, load_private_key, sign

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry


def planned_snapshot(store: Any, receipt_id: str) -> str | None:
    """The snapshot key the pipeline planned this receipt for; None: the pipeline never wrote it."""
    versions = store.document_versions(RECEIPT_SNAPSHOTS, receipt_id)
    return None if not versions else str(versions[-1].body["snapshot_key"])


def _as_receipt(value: Any) -> Receipt:
    if isinstance(value, Receipt):
        return value
    if isinstance(value, Mapping):
        return parse_receipt(dict(value))
    raise TypeError(f"expected a receipt id, Receipt or receipt dict, got {type(value).__name__}")


def load(store: Any, value: Any, *, ingest: Roles | None = None) -> StoredReceipt:
    """The verified ledger head of a receipt given by id, `Receipt` or dict (which must equal it). With
    `ingest` (roles), a receipt the ledger lacks becomes version 1 once its approvals verify."""
    if isinstance(value, str):
        stored = stored_head(store, value)
        if stored is None:
            raise RegistryError(f"receipt {value!r} is not in the ledger")
        return stored
    receipt = _as_receipt(value)
    stored = stored_head(store, receipt.receipt_id)
    if stored is None:
        if ingest is None:
            raise RegistryError(f"receipt {receipt.receipt_id!r} is not in the ledger")
        if (key := planned_snapshot(store, receipt.receipt_id)) is not None:
            # The pipeline claimed this id for a snapshot: only its stages write that receipt's versions.
            raise RegistryError(
                f"receipt {receipt.receipt_id} belongs to snapshot {key}, whose receipt only the pipeline writes"
            )
        if problems := approval_problems(receipt, ingest.actors):
            raise ApprovalRefused(problems)
        # brought in by hand: the pipeline did not write it, so its key never attests it
        entry = ReceiptLedger(store).append(receipt, attest=False)
        return StoredReceipt(receipt, entry.version, entry.content_hash)
    if content_hash(receipt.to_json_dict()) != content_hash(stored.receipt.to_json_dict()):
        raise PromotionRefused(
            f"receipt {receipt.receipt_id} differs from the ledger's head version {stored.version}"
        )
    return stored


def approval_step(receipt: Receipt, role: str) -> str:
    """Which step (`default` or `canary`) the receipt lets `role` approve; refused if it names neither."""
    if role in receipt.plan.approvers.default:
        return "default"
    if role in receipt.plan.approvers.canary:
        return "canary"
    raise NotAuthorized("", role, f"receipt {receipt.receipt_id} names no step role {role!r} may approve")


def sign_approval(
    receipt: Receipt,
    *,
    actor: str,
    role: str,
    key: Path | str,
    step: str | None = None,
    at: float | None = None,
) -> Approval:
    """`actor`'s approval in `role` of `step` (default: `role`'s) over the evidence, signed with `key`."""
    private = load_private_key(key)
    unsigned = Approval(
        actor=actor,
        role=role,
        step=step or approval_step(receipt, role),
        at=time.time() if at is None else at,
        evidence_hash=evidence_hash(receipt),
    )
    signature = sign(private, APPROVAL, approval_fields(receipt.receipt_id, unsigned))
    return unsigned.model_copy(update={"signature": signature})


def verify_approvals(store: Any, receipt: Receipt, roles: Roles) -> None:
    earlier = ReceiptLedger(store).evidence_hashes(receipt.receipt_id)
    if problems := approval_problems(receipt, roles.actors, earlier):
        raise ApprovalRefused(problems)


def approve(reg: Registry, receipt: Any, approval: Approval) -> StoredReceipt:
    """Record a verified signed approval as a new receipt version, tagging it on the candidate's version."""
    roles = registry_roles(reg)
    amended = add_approval(load(reg.store, receipt, ingest=roles).receipt, approval)
    verify_approvals(reg.store, amended, roles)
    entry = ReceiptLedger(reg.store).append(amended)
    stored = StoredReceipt(amended, entry.version, entry.content_hash)
    receipt_tags.write_after(reg, stored)
    return stored


def mlflow_record(
    store: Any, tracking_uri: str, model_name: str, receipt_id: str, model_version: str
) -> tuple[str | None, str, int]:
    from lightning_dagster.registry.core import Registry

    return receipt_tags.compare(Registry(tracking_uri, store, model_name), receipt_id, model_version)
