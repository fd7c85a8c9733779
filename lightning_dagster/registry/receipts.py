"""The registry's view of the gate's update receipt: the facts promotion needs, signed approvals as new
versions (verified against the deployment's roles before anything is appended).

The receipt's schema, hashing, ledger and verdict belong to `lightning_dagster.gate`; this module reads the
typed fields the pointer rules depend on (`plan.parent.model_version`, `candidate.model_version`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_dagster.gate import ReceiptLedger, content_hash, parse_receipt
from lightning_dagster.gate.approvals import approval_problems, evidence_hash
from lightning_dagster.gate.ledger import COLLECTION as LEDGER
from lightning_dagster.gate.ledger import RECEIPT_SNAPSHOTS
from lightning_dagster.gate.receipt import Approval, Receipt, add_approval
from lightning_dagster.registry.errors import ApprovalRefused, NotAuthorized, PromotionRefused, RegistryError
from lightning_dagster.registry.roles import Roles

DRILLS = "rollback_drills"


@dataclass(frozen=True)
class StoredReceipt:
    receipt: Receipt
    version: int  # the ledger version (1, 2, ...)
    content_hash: str  # the ledger's hash of that version (covers body and link)


@dataclass(frozen=True)
class ReceiptFacts:
    receipt_id: str
    candidate_version: str
    candidate_weights_hash: str | None
    candidate_files_hash: str | None  # None: a receipt written before checkpoint files were hashed
    parent_version: str | None  # None: the parent is named by weights hash only
    parent_weights_hash: str | None


def same_hash(a: str | None, b: str | None) -> bool:
    """Weights hashes compare without their optional `sha256:` prefix: the engine writes bare hex while a
    receipt may carry the prefixed form, and `gate.hashing` defines no weights-hash format to share."""
    return bool(a) and bool(b) and a.removeprefix("sha256:") == b.removeprefix("sha256:")


def _registered(value: str | None, field: str, receipt: Receipt, model_name: str) -> str | None:
    """A receipt's typed version field, checked to be a version number (never recovered from a URI)."""
    if value is not None and not value.isdigit():
        raise PromotionRefused(
            f"receipt {receipt.receipt_id}: {field} {value!r} is not a version number of {model_name}"
        )
    return value


def facts(receipt: Receipt, model_name: str) -> ReceiptFacts:
    """The identities promotion checks; a receipt that does not name them is refused, naming the field.

    The parent is named by `plan.parent.model_version` and/or `plan.parent.weights_hash` (at least one);
    the candidate by `candidate.model_version`."""
    plan = receipt.plan
    parent = _registered(plan.parent.model_version, "plan.parent.model_version", receipt, model_name)
    if parent is None and not plan.parent.weights_hash:
        raise PromotionRefused(
            f"receipt {receipt.receipt_id}: plan.parent names neither a version of {model_name} nor weights"
        )
    cand = receipt.candidate
    if cand is None:
        raise PromotionRefused(f"receipt {receipt.receipt_id}: no candidate recorded")
    candidate = _registered(cand.model_version, "candidate.model_version", receipt, model_name)
    if candidate is None:
        raise PromotionRefused(f"receipt {receipt.receipt_id}: candidate.model_version is not recorded")
    return ReceiptFacts(
        receipt_id=receipt.receipt_id,
        candidate_version=candidate,
        candidate_weights_hash=cand.weights_hash,
        candidate_files_hash=cand.files_hash,
        parent_version=parent,
        parent_weights_hash=plan.parent.weights_hash,
    )


def planned_snapshot(store: Any, receipt_id: str) -> str | None:
    """The snapshot key the pipeline planned this receipt for; None: the pipeline never wrote it."""
    versions = store.document_versions(RECEIPT_SNAPSHOTS, receipt_id)
    return None if not versions else str(versions[-1].body["snapshot_key"])


def require_pipeline_written(store: Any, receipt: Receipt) -> str:
    """The receipt's snapshot key, or `PromotionRefused` unless the pipeline wrote the receipt and its gate
    judged it. A receipt brought in by hand carries figures (held-out means, coverage, retry debt, canary
    results, approvals of its own invention) that no stage recorded; the gate would judge them as written."""
    key = planned_snapshot(store, receipt.receipt_id)
    if key is None:
        raise PromotionRefused(
            f"receipt {receipt.receipt_id} was not written by the pipeline (no snapshot planned it): "
            "a receipt brought in by hand is never promoted, its evidence is not what the store recorded"
        )
    if receipt.gate is None:
        raise PromotionRefused(
            f"receipt {receipt.receipt_id} has no gate verdict: materialize release_receipt for snapshot {key} first"
        )
    return key


def _as_receipt(value: Any) -> Receipt:
    if isinstance(value, Receipt):
        return value
    if isinstance(value, Mapping):
        return parse_receipt(dict(value))
    raise TypeError(f"expected a receipt id, Receipt or receipt dict, got {type(value).__name__}")


def _head(ledger: ReceiptLedger, rid: str) -> StoredReceipt | None:
    entries = ledger.history(rid)
    if not entries:
        return None
    # verify=True: a tampered chain raises TamperedReceipt instead of promoting edited evidence.
    return StoredReceipt(ledger.head(rid, verify=True), entries[-1].version, entries[-1].content_hash)


def load(store: Any, value: Any, *, ingest: Roles | None = None) -> StoredReceipt:
    """The ledger's verified head version of a receipt given by id, `Receipt` or dict.

    A receipt passed by value must equal the stored head: acting on a copy that differs from the ledger
    (older, or edited) is refused. With `ingest` (the deployment's roles), a receipt the ledger has never
    seen becomes version 1, once every approval it carries verifies against those roles."""
    ledger = ReceiptLedger(store)
    if isinstance(value, str):
        stored = _head(ledger, value)
        if stored is None:
            raise RegistryError(f"receipt {value!r} is not in the ledger")
        return stored
    receipt = _as_receipt(value)
    stored = _head(ledger, receipt.receipt_id)
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
        entry = ledger.append(receipt)
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
    raise NotAuthorized("", role, f"receipt {receipt.receipt_id} names no step this role may approve")


def verify_approvals(store: Any, receipt: Receipt, roles: Roles) -> None:
    """Raise `ApprovalRefused` unless every approval of `receipt` verifies against `roles`; a canary
    approval may sign the evidence of any stored version of the same receipt (see `gate.approvals`)."""
    versions = store.document_versions(LEDGER, receipt.receipt_id)
    earlier = {evidence_hash(parse_receipt(v.body)) for v in versions}
    if problems := approval_problems(receipt, roles.actors, earlier):
        raise ApprovalRefused(problems)


def record_approval(store: Any, value: Any, approval: Approval, roles: Roles) -> StoredReceipt:
    """Append a signed approval as a new receipt version after the current head, once it verifies (as do
    the approvals already there). A receipt given by value that the ledger lacks is ingested first."""
    stored = load(store, value, ingest=roles)
    amended = add_approval(stored.receipt, approval)
    verify_approvals(store, amended, roles)
    entry = ReceiptLedger(store).append(amended)
    return StoredReceipt(amended, entry.version, entry.content_hash)


def record_drill(store: Any, model_name: str, result: Mapping[str, Any]) -> int:
    """Append a rollback drill's outcome to the store (collection `rollback_drills`, one chain per version)."""
    doc_id = f"{model_name}/{result['version']}"
    versions = store.document_versions(DRILLS, doc_id)
    previous = versions[-1].content_hash if versions else None
    body = dict(result)
    return store.append_document(
        DRILLS, doc_id, content_hash({"previous": previous, "drill": body}), body, previous
    )
