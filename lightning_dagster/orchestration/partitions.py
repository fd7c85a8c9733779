"""The `snapshots` dynamic partitions: one per frozen data snapshot, keyed by its content hash (cut and
validated by the core, `pipeline.snapshots`, so scripts make the same keys without Dagster)."""

from __future__ import annotations

import dagster as dg

snapshots = dg.DynamicPartitionsDefinition(name="snapshots")
