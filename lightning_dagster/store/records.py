"""Records the store returns beyond the shared data model: document versions and pointer moves."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class StoredDocument(BaseModel):
    """One version of an append-only document; `previous_hash` is the content hash of version - 1."""

    model_config = ConfigDict(frozen=True)

    collection: str
    doc_id: str
    version: int
    content_hash: str
    previous_hash: str | None
    body: dict[str, Any]
    created_at: float


class PointerMove(BaseModel):
    """One compare-and-set move of a named pointer; `seq` counts the pointer's moves from 1."""

    model_config = ConfigDict(frozen=True)

    name: str
    from_value: str | None
    to_value: str
    actor: str
    receipt_id: str | None
    note: str
    moved_at: float
    seq: int
