"""The `snapshots` dynamic partitions: one partition per frozen data snapshot, keyed by its content hash."""

from __future__ import annotations

import datetime as dt
import re

import dagster as dg

snapshots = dg.DynamicPartitionsDefinition(name="snapshots")

# Letters, digits, `.`, `_` and `-` only: the UI and backfills misbehave on commas, pipes and brackets.
SNAPSHOT_KEY_PATTERN = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class InvalidSnapshotKey(ValueError):
    """A partition key that the `snapshots` partitions refuse."""


def validate_snapshot_key(key: str) -> str:
    if not isinstance(key, str) or not SNAPSHOT_KEY_PATTERN.match(key):
        raise InvalidSnapshotKey(
            f"snapshot key {key!r} must be 1-128 characters of letters, digits, '.', '_' or '-'"
        )
    return key


def snapshot_key(content_hash: str, at: dt.datetime) -> str:
    """`snap-20261130T0800Z-1a2b3c4d`: minute of the cut (UTC) and the first 8 hex digits of the content hash."""
    if not re.fullmatch(r"[0-9a-f]{8,}", content_hash):
        raise InvalidSnapshotKey(f"content hash {content_hash!r} is not lowercase hex")
    stamp = at.astimezone(dt.UTC).strftime("%Y%m%dT%H%MZ")
    return validate_snapshot_key(f"snap-{stamp}-{content_hash[:8]}")
