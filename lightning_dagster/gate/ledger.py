"""Immutable receipts: each version is content-hashed and appended to the store's append-only documents;
an amendment is a new version pointing at the one before.

The hash covers body and link (`sha256(canonical({"previous_hash", "receipt"}))`), so an edit breaks
`verify_chain`. Amendments may only add; the gate's own record (`gate`) may be replaced, since a later
evaluation under another policy is a new judgement of the same evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from lightning_dagster.gate.errors import AmendmentError, InvalidInput, TamperedReceipt
from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.gate.receipt import Receipt, parse_receipt
from lightning_dagster.release.approvals import evidence_hash

COLLECTION = "receipts"
# receipt id -> the snapshot key the pipeline planned it for, written by the pipeline with a receipt's first
# version and by nothing else: what tells a receipt whose evidence the pipeline's stages recorded from one
# brought in by hand (`registry approve|promote FILE.json`).
RECEIPT_SNAPSHOTS = "receipt-snapshots"
REPLACEABLE = frozenset({"gate"})


class DocumentStore(Protocol):
    """The two methods of `lightning_dagster.store.Store` the ledger uses (see CONTRACTS.md)."""

    def append_document(
        self, collection: str, doc_id: str, content_hash: str, body: dict, previous_hash: str | None
    ) -> int: ...

    def document_versions(self, collection: str, doc_id: str) -> list[Any]: ...


def version_hash(body: dict, previous_hash: str | None) -> str:
    return content_hash({"previous_hash": previous_hash, "receipt": body})


def check_amendment(before: Any, after: Any, path: str = "") -> None:
    """Raise `AmendmentError` unless `after` only adds to `before` (JSON data of two receipt versions)."""
    if before is None:
        return
    if isinstance(before, dict) and isinstance(after, dict):
        for key in before:
            if not path and key in REPLACEABLE:
                continue
            check_amendment(before[key], after.get(key), f"{path}.{key}" if path else key)
    elif isinstance(before, list) and isinstance(after, list):
        if len(after) < len(before):
            raise AmendmentError(path, f"{len(before) - len(after)} entries removed")
        for i, (b, a) in enumerate(zip(before, after, strict=False)):
            if b != a:
                check_amendment(b, a, f"{path}.{i}")
    elif before != after:
        raise AmendmentError(path, f"recorded value {before!r} cannot change to {after!r}")


@dataclass
class ChainReport:
    receipt_id: str
    ok: bool
    versions: int
    head_hash: str | None
    problems: list[str] = field(default_factory=list)


@dataclass
class LedgerEntry:
    receipt_id: str
    version: int
    content_hash: str
    previous_hash: str | None


class ReceiptLedger:
    def __init__(self, store: DocumentStore):
        self.store = store

    def append(self, receipt: Receipt) -> LedgerEntry:
        """Store a receipt: version 1, or an amendment of the head (concurrent writers: `Conflict`)."""
        body = receipt.to_json_dict()
        versions = self.store.document_versions(COLLECTION, receipt.receipt_id)
        previous = versions[-1] if versions else None
        if previous is not None:
            check_amendment(previous.body, body)
            if version_hash(body, previous.previous_hash) == previous.content_hash:
                # the head already holds exactly this receipt: nothing to amend
                return LedgerEntry(
                    receipt.receipt_id, previous.version, previous.content_hash, previous.previous_hash
                )
        prev_hash = previous.content_hash if previous is not None else None
        digest = version_hash(body, prev_hash)
        version = self.store.append_document(COLLECTION, receipt.receipt_id, digest, body, prev_hash)
        return LedgerEntry(receipt.receipt_id, version, digest, prev_hash)

    def verify_chain(self, receipt_id: str, expected_head: str | None = None) -> ChainReport:
        """Recompute every version's hash and link. `expected_head` (e.g. the hash recorded with a pointer
        move) also catches a rewrite of the newest version together with its hash."""
        versions = sorted(self.store.document_versions(COLLECTION, receipt_id), key=lambda d: d.version)
        problems: list[str] = []
        prev_hash: str | None = None
        for i, doc in enumerate(versions, start=1):
            if doc.version != i:
                problems.append(f"version {doc.version} found where {i} was expected")
            if doc.previous_hash != prev_hash:
                problems.append(f"version {doc.version} links to {doc.previous_hash}, not {prev_hash}")
            try:
                recomputed = version_hash(doc.body, doc.previous_hash)
            except (ValueError, TypeError, RecursionError) as err:
                # `append` hashed every body it wrote: one that cannot be hashed was written around it
                recomputed = f"unhashable ({type(err).__name__})"
            if recomputed != doc.content_hash:
                problems.append(f"version {doc.version} body does not match its hash {doc.content_hash}")
            prev_hash = doc.content_hash
        if not versions:
            problems.append("no versions stored")
        if expected_head is not None and prev_hash != expected_head:
            problems.append(f"head is {prev_hash}, expected {expected_head}")
        return ChainReport(receipt_id, not problems, len(versions), prev_hash, problems)

    def head(self, receipt_id: str, *, verify: bool = True) -> Receipt:
        """The newest version as a `Receipt`; with `verify`, raises `TamperedReceipt` on a broken chain."""
        if verify:
            report = self.verify_chain(receipt_id)
            if not report.ok:
                raise TamperedReceipt(f"receipt {receipt_id}: " + "; ".join(report.problems))
        versions = self.store.document_versions(COLLECTION, receipt_id)
        if not versions:
            raise InvalidInput("receipt", [("receipt_id", f"no receipt {receipt_id!r} in the ledger")])
        return parse_receipt(versions[-1].body)

    def evidence_hashes(self, receipt_id: str) -> set[str]:
        """The evidence hash of every stored version: what a canary approval, signed before the evidence it
        precedes, may bind (`gate.evaluate(earlier=...)`)."""
        versions = self.store.document_versions(COLLECTION, receipt_id)
        return {evidence_hash(parse_receipt(d.body)) for d in versions}

    def history(self, receipt_id: str) -> list[LedgerEntry]:
        return [
            LedgerEntry(receipt_id, d.version, d.content_hash, d.previous_hash)
            for d in self.store.document_versions(COLLECTION, receipt_id)
        ]
