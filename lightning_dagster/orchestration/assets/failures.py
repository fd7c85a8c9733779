"""What an asset or check of a snapshot raises when it cannot run: a one-line `dg.Failure`, not a traceback
(a key that is not a snapshot key, anyone may add in the UI, before any path is built)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import dagster as dg


@contextmanager
def snapshot_stage(what: str, partition_key: str | None) -> Iterator[str]:
    """Run a stage of the snapshot `partition_key` names; its expected refusals become a `dg.Failure`."""
    from lightning_dagster.gate.errors import AmendmentError, InvalidInput, TamperedReceipt
    from lightning_dagster.pipeline.context import (
        CandidateRecorded,
        ForeignReceipt,
        NotRegistered,
        StageMissing,
    )
    from lightning_dagster.pipeline.snapshots import (
        InvalidSnapshotKey,
        SnapshotTampered,
        validate_snapshot_key,
    )
    from lightning_dagster.pipeline.transitions_file import TokenizerMismatch
    from lightning_dagster.registry.errors import RegistryError
    from lightning_dagster.store.errors import Conflict, StoreUnavailable
    from lightning_dagster.training.transitions import TooManyExcludedRollouts

    try:
        key = validate_snapshot_key(partition_key)  # type: ignore[arg-type]
    except InvalidSnapshotKey as exc:
        raise dg.Failure(
            description=f"{what} refused: {exc}",
            metadata={"refused": type(exc).__name__, "partition_key": repr(partition_key)},
            allow_retries=False,
        ) from None

    try:
        yield key
    except (
        StageMissing,
        CandidateRecorded,
        ForeignReceipt,
        NotRegistered,
        SnapshotTampered,
        TamperedReceipt,
        InvalidInput,
        RegistryError,
        StoreUnavailable,
        # another run of the same snapshot wrote first: the record stands as that run wrote it
        Conflict,
        AmendmentError,
        # the first batch's data refused (invalid spans, or another tokenizer than the parent's)
        TooManyExcludedRollouts,
        TokenizerMismatch,
    ) as exc:
        reason = " ".join(str(exc).split())
        metadata = {"error": type(exc).__name__, "reason": reason, "snapshot": key}
        if isinstance(exc, StageMissing):
            metadata["materialize_first"] = exc.stage
        raise dg.Failure(
            description=f"{what} of snapshot {key} failed: {reason}", metadata=metadata, allow_retries=False
        ) from None
