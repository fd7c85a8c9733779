"""The `snapshots` dynamic partitions: one partition per frozen data snapshot, keyed by its content hash.

Keys are cut and validated by the core (`pipeline.snapshots.snapshot_key`), so sensors, the schedule and
scripts make the same keys without Dagster."""

from __future__ import annotations

import dagster as dg

snapshots = dg.DynamicPartitionsDefinition(name="snapshots")
