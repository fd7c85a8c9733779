"""Canonical JSON and content hashes: the one serialisation every receipt hash, policy hash, fingerprint and
signed message goes through. Standard library only: the gate and the release's signatures both build on it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8, and no NaN or infinity (they have no canonical JSON form)."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def content_hash(obj: Any) -> str:
    """`sha256:<hex>` over the canonical JSON of `obj`."""
    return "sha256:" + hashlib.sha256(canonical_json(obj)).hexdigest()
