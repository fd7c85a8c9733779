"""Pointer incidents: `approved-default`'s MLflow mirror found changed behind the registry's back, or its
store history not verifying, in the store's append-only documents (`pointer_incidents`). MLflow records
neither who nor when an alias changed, so the actor is "unknown" and the time a window: after the registry
last wrote or verified the mirror (`not_before`), at or before the watch found it (`detected_at`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.store.documents import append_chained

COLLECTION = "pointer_incidents"
UNKNOWN_ACTOR = "unknown"
ACTOR_SOURCE = "MLflow records no author or time for alias changes"


@dataclass(frozen=True)
class PointerIncident:
    """What the watch found and did; `number` is the incident's place in the pointer's chain (from 1)."""

    pointer: str  # the store's pointer name
    model: str
    alias: str
    found_version: str | None  # the version MLflow's alias named; None: the alias had been deleted
    store_version: str | None  # the store's pointer, which the alias was restored to
    store_seq: int | None
    detected_at: float
    not_before: float | None  # the registry last wrote or saw the alias agree with the store then
    restored: bool
    error: str | None = None  # why the alias could not be restored
    moved_by: str = UNKNOWN_ACTOR
    moved_by_source: str = ACTOR_SOURCE
    # The mirror was changed outside the registry; `differences` names each field found otherwise (an
    # incident recorded before the whole mirror was compared reads back as False with none).
    tampered: bool = False
    differences: list[str] = field(default_factory=list)
    # The store's history did not verify: its first bad record (`found_version`: the pointer row's value,
    # `store_version`: the last verified move's, which the pointer reads as).
    chain: str = ""
    number: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        if self.chain:
            return (
                f"{self.pointer}'s history does not verify: {self.chain}; it reads as "
                f"{self.store_version or '(unset)'} (move {self.store_seq or 0}), serving refuses"
            )
        found = "deleted" if self.found_version is None else f"version {self.found_version}"
        outcome = "restored to" if self.restored else f"NOT restored ({self.error}); the store says"
        if self.found_version == self.store_version and self.differences:
            what = f"MLflow mirror of {self.alias} of {self.model} was tampered with ({'; '.join(self.differences)})"
        else:
            what = f"MLflow alias {self.alias} of {self.model} was {found}, not the store's pointer"
        return f"{what}; {outcome} {self.store_version or '(unset)'} (moved by {self.moved_by})"


def record(store, incident: PointerIncident) -> PointerIncident:
    """Append the incident to its pointer's chain (retried on a concurrent append), numbered."""
    body = {k: v for k, v in incident.to_dict().items() if k != "number"}
    digest = lambda head: content_hash({"previous": head, **body})  # noqa: E731
    return replace(incident, number=append_chained(store, COLLECTION, incident.pointer, body, digest))


def incidents(store, pointer: str) -> list[PointerIncident]:
    known = {f.name for f in fields(PointerIncident)}
    return [
        PointerIncident(**{k: v for k, v in doc.body.items() if k in known}, number=doc.version)
        for doc in store.document_versions(COLLECTION, pointer)
    ]
