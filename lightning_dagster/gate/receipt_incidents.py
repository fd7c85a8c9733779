"""Receipt incidents: a stored receipt chain a verifying reader found broken (a body, hash or link changed, a
version missing or out of place, an attestation that does not verify), in the store's append-only documents
(`receipt_incidents`, doc id = receipt id). A break is recorded once, keyed by its first bad version and its
problem: later readers, and a concurrent one whose append lost the head, find it there.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from lightning_dagster.gate.hashing import content_hash

COLLECTION = "receipt_incidents"


@dataclass(frozen=True)
class ReceiptIncident:
    """One break of a receipt's chain; `number` is its place in the receipt's incidents (from 1)."""

    receipt_id: str
    version: int  # the first stored version that does not verify
    problem: str  # what is wrong with it: the chain's first problem
    problems: list[str] = field(default_factory=list)  # every problem the reader found
    head_hash: str | None = None  # the head as the reader found it
    detected_at: float = 0.0
    reader: str = ""  # which read found it ("ledger read", "ledger amendment", "gate verify")
    number: int = 0

    def summary(self) -> str:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.detected_at))
        return (
            f"receipt incident {self.number} ({when}, found by {self.reader or 'a reader'}): "
            f"receipt {self.receipt_id}: {self.problem}"
        )


def incidents(store: Any, receipt_id: str) -> list[ReceiptIncident]:
    """Every recorded incident of `receipt_id`, oldest first (a body not of an incident's shape is left out)."""
    return _parse(store.document_versions(COLLECTION, receipt_id))


def _parse(docs: list[Any]) -> list[ReceiptIncident]:
    known = {f.name for f in fields(ReceiptIncident)} - {"number"}
    found = []
    for doc in docs:
        try:
            found.append(
                ReceiptIncident(**{k: v for k, v in doc.body.items() if k in known}, number=doc.version)
            )
        except TypeError:
            continue
    return found


def _same(found: list[ReceiptIncident], version: int, problem: str) -> ReceiptIncident | None:
    return next((i for i in found if (i.version, i.problem) == (version, problem)), None)


def record_once(
    store: Any,
    receipt_id: str,
    version: int,
    problem: str,
    *,
    problems: list[str] | None = None,
    head_hash: str | None = None,
    reader: str = "",
) -> tuple[ReceiptIncident, bool]:
    """The incident recording this break, appended unless one already records it; and whether it was new."""
    # The store's documents load SQLAlchemy: only when there is a break to record.
    from lightning_dagster.store.documents import append_chained

    incident = ReceiptIncident(
        receipt_id, version, problem, list(problems or [problem]), head_hash, time.time(), reader
    )
    body = {k: v for k, v in asdict(incident).items() if k != "number"}
    digest = lambda head: content_hash({"previous": head, **body})  # noqa: E731
    recorded = lambda versions: _same(_parse(versions), version, problem) is not None  # noqa: E731
    number = append_chained(store, COLLECTION, receipt_id, body, digest, unless=recorded)
    if number is None:
        return _same(incidents(store, receipt_id), version, problem), False
    return replace(incident, number=number), True
