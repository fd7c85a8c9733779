"""Immutable receipts: each version is content-hashed (body and link) and appended to the store's append-only
documents. An amendment is a new version that only adds (the gate's record may be replaced: a later
evaluation under another policy is a new judgement of the same evidence). An edit breaks `verify_chain`; a
rewrite that recomputes the hashes fails each version's pipeline attestation (`gate.attestation`). A
verifying read refuses a break (`TamperedReceipt`) and records it once as a receipt incident."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol
from weakref import WeakKeyDictionary

from lightning_dagster.gate import attestation, receipt_incidents
from lightning_dagster.gate.attestation import ATTESTATIONS, NO_KEYS, Attestation, PipelineKeys
from lightning_dagster.gate.errors import AmendmentError, InvalidInput, TamperedReceipt
from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.gate.receipt import Receipt, parse_receipt
from lightning_dagster.gate.receipt_incidents import ReceiptIncident
from lightning_dagster.release.approvals import evidence_hash

COLLECTION = "receipts"
# receipt id -> the snapshot key the pipeline planned it for, written only by the pipeline with a receipt's
# first version: what tells its receipts from one brought in by hand (`registry approve|promote FILE.json`).
RECEIPT_SNAPSHOTS = "receipt-snapshots"
REPLACEABLE = frozenset({"gate"})
# store -> the deployment's pipeline keys, for every ledger over that store (`use_keys`)
_KEYS: WeakKeyDictionary[Any, PipelineKeys] = WeakKeyDictionary()


def use_keys(store: Any, keys: PipelineKeys) -> None:
    """Every `ReceiptLedger(store)` from now on attests and verifies with `keys` (`pipeline_key.keys`)."""
    _KEYS[store] = keys


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
    first_bad: int | None = None  # the first stored version that does not verify (None: every one does)


@dataclass
class LedgerEntry:
    receipt_id: str
    version: int
    content_hash: str
    previous_hash: str | None
    attested: bool = False  # written with the pipeline's attestation


class ReceiptLedger:
    def __init__(self, store: DocumentStore, keys: PipelineKeys | None = None):
        self.store = store
        self.keys = keys if keys is not None else _KEYS.get(store, NO_KEYS)

    @property
    def attesting(self) -> bool:
        return self.keys.signing is not None

    def append(self, receipt: Receipt, *, attest: bool = True) -> LedgerEntry:
        """Store a receipt: version 1, or an amendment of the head (concurrent writers: `Conflict`), attested
        with the pipeline key unless `attest=False` (a receipt brought in by hand). An attesting ledger amends
        only a chain that verifies: it never signs evidence built on a version it did not write."""
        rid, body, attested = receipt.receipt_id, receipt.to_json_dict(), self.attesting and attest
        versions = self.store.document_versions(COLLECTION, rid)
        previous = versions[-1] if versions else None
        prev_hash = previous.content_hash if previous is not None else None
        if previous is not None:
            if attested and not (report := self.verify_chain(rid)).ok:
                raise self._tampered(report, "ledger amendment")
            check_amendment(previous.body, body)
            if version_hash(body, previous.previous_hash) == prev_hash:
                # the head already holds exactly this receipt (its attestation verified above): nothing to do
                return LedgerEntry(rid, previous.version, prev_hash, previous.previous_hash, attested)
        digest = version_hash(body, prev_hash)
        version = self.store.append_document(COLLECTION, rid, digest, body, prev_hash)
        if attested:
            att = attestation.attest(self.keys.signing, rid, version, digest, prev_hash)
            stored = self.store.document_versions(ATTESTATIONS, rid)
            doc = att.model_dump(mode="json")
            link = stored[-1].content_hash if stored else None
            self.store.append_document(ATTESTATIONS, rid, content_hash(doc), doc, link)
        return LedgerEntry(rid, version, digest, prev_hash, attested)

    def attestations(self, receipt_id: str) -> dict[int, list[Attestation]]:
        """Version number -> the attestations stored for it (a malformed one is left out: it proves nothing)."""
        found: dict[int, list[Attestation]] = {}
        for doc in self.store.document_versions(ATTESTATIONS, receipt_id):
            try:
                att = attestation.parse(doc.body)
            except (InvalidInput, ValueError, TypeError):
                continue
            found.setdefault(att.version, []).append(att)
        return found

    def attestation_of(self, receipt_id: str, version: int, content_hash: str) -> Attestation | None:
        """The stored attestation that verifies for this version (else the first stored, else None)."""
        candidates, key = self.attestations(receipt_id).get(version, []), self.keys.public
        good = [
            a for a in candidates if key and attestation.problem(key, receipt_id, content_hash, a) is None
        ]
        return (good or candidates or [None])[0]

    def verify_chain(self, receipt_id: str, expected_head: str | None = None) -> ChainReport:
        """Recompute every version's hash and link and, with a public pipeline key, verify its attestation.
        `expected_head` (e.g. recorded with a pointer move) also catches a rewrite of the newest version."""
        versions = sorted(self.store.document_versions(COLLECTION, receipt_id), key=lambda d: d.version)
        problems: list[str] = []
        attested = self.attestations(receipt_id) if self.keys.public else {}
        prev_hash: str | None = None
        first_bad: int | None = None
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
            if self.keys.public:
                found = [
                    attestation.problem(self.keys.public, receipt_id, recomputed, att)
                    for att in attested.get(doc.version, [None])
                ]
                if None not in found:
                    problems.append(f"version {doc.version}: {found[0]}")
            if problems and first_bad is None:
                first_bad = doc.version
            prev_hash = doc.content_hash
        if not versions:
            problems.append("no versions stored")
        if expected_head is not None and prev_hash != expected_head:
            problems.append(f"head is {prev_hash}, expected {expected_head}")
        return ChainReport(receipt_id, not problems, len(versions), prev_hash, problems, first_bad)

    def record_break(self, report: ChainReport, reader: str) -> tuple[ReceiptIncident, bool] | None:
        """The receipt incident recording `report`'s break (once per first bad version and problem), and
        whether this call recorded it; None without a break in the chain (a mismatched head is not one)."""
        if report.first_bad is None:
            return None
        return receipt_incidents.record_once(
            self.store,
            report.receipt_id,
            report.first_bad,
            report.problems[0],
            problems=report.problems,
            head_hash=report.head_hash,
            reader=reader,
        )

    def _tampered(self, report: ChainReport, reader: str) -> TamperedReceipt:
        message = f"receipt {report.receipt_id}: " + "; ".join(report.problems)
        try:
            recorded = self.record_break(report, reader)
        except Exception as err:  # noqa: BLE001 - a store that cannot take the record still refuses the read
            return TamperedReceipt(
                f"{message} (the break could not be recorded as a receipt incident: {err})"
            )
        if recorded is None:
            return TamperedReceipt(message)
        incident, new = recorded
        when = "recorded" if new else "already recorded"
        return TamperedReceipt(f"{message} ({when} as receipt incident {incident.number})", incident)

    def head(self, receipt_id: str, *, verify: bool = True) -> Receipt:
        """The newest version; with `verify`, `TamperedReceipt` on a broken chain (recorded once)."""
        if verify:
            report = self.verify_chain(receipt_id)
            if not report.ok:
                raise self._tampered(report, "ledger read")
        versions = self.store.document_versions(COLLECTION, receipt_id)
        if not versions:
            raise InvalidInput("receipt", [("receipt_id", f"no receipt {receipt_id!r} in the ledger")])
        return parse_receipt(versions[-1].body)

    def evidence_hashes(self, receipt_id: str) -> set[str]:
        """Every stored version's evidence hash: what a canary approval may have signed."""
        versions = self.store.document_versions(COLLECTION, receipt_id)
        return {evidence_hash(parse_receipt(d.body)) for d in versions}

    def export(self, receipt_id: str, version: int | None = None) -> dict[str, Any]:
        """A stored receipt version (default: the head) as a receipt file's JSON, carrying its attestation."""
        versions = self.store.document_versions(COLLECTION, receipt_id)
        doc = next((d for d in reversed(versions) if version in (None, d.version)), None)
        if doc is None:
            which = "any version" if version is None else f"version {version}"
            raise InvalidInput("receipt", [("receipt_id", f"the ledger holds no {which} of {receipt_id!r}")])
        att = self.attestation_of(receipt_id, doc.version, doc.content_hash)
        return attestation.with_attestation(doc.body, att)

    def history(self, receipt_id: str) -> list[LedgerEntry]:
        return [
            LedgerEntry(receipt_id, d.version, d.content_hash, d.previous_hash)
            for d in self.store.document_versions(COLLECTION, receipt_id)
        ]


def file_problem(receipt: Receipt, att: Attestation | None, public_key: str) -> str | None:
    """Why a receipt file is not a version the pipeline attested under `public_key` (None: it is)."""
    digest = version_hash(receipt.to_json_dict(), att.previous_hash if att else None)
    return attestation.problem(public_key, receipt.receipt_id, digest, att)
