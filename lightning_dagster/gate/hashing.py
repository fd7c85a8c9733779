"""Content hashes and fingerprints: every receipt hash, policy hash and fingerprint goes through the one
canonical serialisation (`lightning_dagster.canonical`), so equal content always hashes equal and any
change shows."""

from __future__ import annotations

from typing import Any

from lightning_dagster.canonical import canonical_json, content_hash

__all__ = ["canonical_json", "content_hash", "fingerprint"]


def fingerprint(obj: Any) -> str:
    """A fingerprint for staleness: the content hash of plain JSON data (evaluator config, tools, ...)."""
    return content_hash(obj)
