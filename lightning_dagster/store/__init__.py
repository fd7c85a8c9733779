"""The durable store (SQLite by default, PostgreSQL by URL); see docs/CONTRACTS.md `store`."""

from lightning_dagster.store.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    PointerConflict,
    PointerSeqConflict,
)
from lightning_dagster.store.records import PointerMove, StoredDocument
from lightning_dagster.store.store import Store
from lightning_dagster.types import IllegalTransition

__all__ = [
    "Conflict", "IllegalTransition", "InvalidInput", "NotFound", "PointerConflict", "PointerMove",
    "PointerSeqConflict", "Store", "StoredDocument",
]  # fmt: skip
