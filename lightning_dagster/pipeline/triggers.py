"""What the sensors and the schedule decide, without Dagster: new evidence, stop conditions, stale receipts.
The continual-learning cursor is a small watermark (the newest serve rollout consumed and the task pool's
fingerprint, so an edited tasks file cuts a snapshot), never the set of everything seen.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.snapshots import build_manifest, snapshot_key

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import Receipt
    from lightning_dagster.pipeline.loop_history import LoopState
    from lightning_dagster.pipeline.run import Pipeline
    from lightning_dagster.store import Store


class InvalidCursor(ValueError):
    """The continual-learning sensor's cursor is not a watermark (edited by hand, or corrupt)."""

    def __init__(self, cursor: str, why: str):
        shown = cursor if len(cursor) <= 80 else cursor[:77] + "..."
        super().__init__(
            f"continual_learning_sensor cursor {shown!r} is not a watermark ({why}); set one "
            "(`dagster sensor cursor continual_learning_sensor --set '{\"serve_after\": <unix time>}'`)"
        )


@dataclass
class Watermark:
    serve_after: float = 0.0  # created_at of the newest serve rollout already in a snapshot
    pool: str | None = None  # fingerprint of the task pool the last snapshot drew from
    decision: str | None = None  # hash of the newest loop decision the sensor has shown

    @classmethod
    def from_cursor(cls, cursor: str | None) -> Watermark:
        """The watermark a cursor holds (an older one without `pool` too); `InvalidCursor` for anything else,
        never a guess (from zero the sensor would snapshot rollouts earlier snapshots hold)."""
        if not cursor:
            return cls()
        try:
            data = json.loads(cursor)
        except ValueError:
            raise InvalidCursor(cursor, "invalid JSON") from None
        if not isinstance(data, dict):
            raise InvalidCursor(cursor, "not a JSON object")
        after, pool, decision = data.get("serve_after", 0.0), data.get("pool"), data.get("decision")
        latest = time.time() + 86400
        if isinstance(after, bool) or not isinstance(after, int | float) or not 0 <= after <= latest:
            raise InvalidCursor(
                cursor, f"serve_after {after!r} is not a time (Unix seconds, not in the future)"
            )
        for name, value in (("pool", pool), ("decision", decision)):
            if value is not None and not isinstance(value, str):
                raise InvalidCursor(cursor, f"{name} {value!r} is not a hash")
        return cls(serve_after=float(after), pool=pool, decision=decision)

    def to_cursor(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


@dataclass
class NewEvidence:
    enough: bool
    summary: str
    watermark: Watermark
    serve_rollout_ids: list[str] = field(default_factory=list)


def new_evidence(p: Pipeline, watermark: Watermark, *, force: bool = False) -> NewEvidence:
    """Enough finished, rewarded serve rollouts since the watermark, or a changed task pool (or `force`)."""
    from lightning_dagster.types import RolloutKind, RolloutStatus

    store = p.get_store()
    fresh = store.query_rollouts(
        kind=RolloutKind.serve, status=RolloutStatus.succeeded, created_after=watermark.serve_after
    )
    ids = [r.rollout_id for r in fresh]
    rewarded = {r.rollout_id for r in store.list_rewards(rollout_ids=ids)} if fresh else set()
    serve = [r for r in fresh if r.rollout_id in rewarded]
    pool = ctx.harness_source(p).dataset.content_hash  # the task distribution
    need = ctx.settings(p).training.min_serve_rollouts
    pool_changed = watermark.pool != pool
    enough = force or pool_changed or len(serve) >= need
    summary = f"{len(serve)} of {need} new rewarded serve rollouts; task pool {'changed' if pool_changed else 'unchanged'}"
    after = max((r.created_at for r in serve), default=watermark.serve_after)
    mark = Watermark(serve_after=after, pool=pool) if enough else watermark
    return NewEvidence(enough, summary, mark, [r.rollout_id for r in serve])


@dataclass(frozen=True)
class Cut:
    """A snapshot the sensor or schedule decided to cut: its key and what its `tasks` run freezes."""

    key: str
    train_seed: int
    serve_rollout_ids: list[str]

    @property
    def config(self) -> dict:
        return {"train_seed": self.train_seed, "serve_rollout_ids": self.serve_rollout_ids}


def cut_snapshot(p: Pipeline, evidence: NewEvidence, now: dt.datetime) -> Cut:
    """The snapshot to cut, nothing written: the `tasks` run freezes it from `Cut.config`. The train seed is
    the settings' seed and the evidence's (task pool, serve rollouts), never the clock's: the same seed and
    data freeze the same tasks."""
    basis = [ctx.settings(p).training.seed, evidence.watermark.pool, sorted(evidence.serve_rollout_ids)]
    seed = int(hashlib.sha256(json.dumps(basis).encode()).hexdigest()[:8], 16) % 1_000_000
    manifest = build_manifest(p, train_seed=seed, serve_rollout_ids=evidence.serve_rollout_ids)
    return Cut(snapshot_key(manifest.digest, now), seed, manifest.serve_rollout_ids)


def _gated(store: Store, keys: list[str]) -> list[tuple[str, Receipt]]:
    """Receipts of the given snapshots that the gate has judged, oldest first."""
    out = []
    for key in keys:
        try:
            receipt = ctx.find_receipt(store, key)
        except ctx.ForeignReceipt:
            continue  # brought in by hand under the snapshot's id: the gate never judged it, nor will it
        if receipt is not None and receipt.gate is not None:
            out.append((key, receipt))
    return out


def stop_decision(p: Pipeline, keys: list[str], *, record: bool = False) -> LoopState:
    """The loop's state: a stop condition of the latest judged receipt, or a parent that is not set or not
    registered, pauses it until an authorized resume or a clearing receipt (`release.pauses`). Only the
    stage that judged a receipt passes `record`; the sensors and the schedule only read."""
    from lightning_dagster.gate.stop import stop_decision as gate_stop
    from lightning_dagster.pipeline.loop_history import tick
    from lightning_dagster.registry.core import APPROVED
    from lightning_dagster.registry.errors import RegistryError

    store, reg = p.get_store(), ctx.registry(p)
    live: list[str] = []
    try:
        version = reg.current(APPROVED)
        if version is None:
            live.append(f"parent unavailable: {APPROVED} is not set")
        else:
            reg.model_version(version)
    except RegistryError as exc:
        live.append(f"parent unavailable: {exc}")
    gated = _gated(store, keys[-20:])
    latest_id, conditions = None, []
    if gated:
        latest, previous = gated[-1][1], (gated[-2][1] if len(gated) > 1 else None)
        latest_id = latest.receipt_id
        conditions = gate_stop(latest, ctx.policy(p), previous).reasons
    # A pause names who may lift it: the deployment's default-approver roles (the one place the `resume` job
    # and `loop resume` read them from).
    roles = ctx.settings(p).gate.default_approver_roles
    return tick(store, latest_id, conditions, live, resume_roles=roles, record=record)


@dataclass
class StaleMark:
    snapshot_key: str
    receipt_id: str
    void_checks: dict[int, list[str]]
    changed: list[str]


def stale_receipts(p: Pipeline, keys: list[str], cursor: str | None) -> tuple[str, list[StaleMark]]:
    """Receipts whose evidence a changed fingerprint voids, each marked once: the returned cursor names the
    receipts marked so far (nothing is written; Dagster keeps the cursor with the tick's observations)."""
    from lightning_dagster.gate.staleness import void_checks

    try:
        seen = json.loads(cursor) if cursor else {}
    except ValueError:
        seen = {}
    marked = set(seen.get("marked", [])) if isinstance(seen, dict) else set()
    store, pol = p.get_store(), ctx.policy(p)
    marks: list[StaleMark] = []
    gated = _gated(store, keys[-200:])
    promoted = {move.receipt_id for move in ctx.registry(p).verified().moves if move.receipt_id}
    for key, receipt in gated:
        if receipt.receipt_id in marked:
            continue
        current = ctx.current_fingerprints(p, key)
        if receipt.receipt_id in promoted:
            current["parent"] = None  # its promotion moved the pointer off its parent: not compared
        void = void_checks(receipt.fingerprints, current, required=pol.staleness.required_fingerprints)
        if void:
            changed = sorted({reason.split(" ", 1)[0] for reasons in void.values() for reason in reasons})
            marks.append(StaleMark(key, receipt.receipt_id, void, changed))
    ids = {r.receipt_id for _, r in gated}  # receipts beyond the window are no longer examined
    marked = sorted((marked & ids) | {m.receipt_id for m in marks})
    return json.dumps({"marked": marked}), marks
