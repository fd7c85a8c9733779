"""Receipt phase 2 straight from the store: a snapshot's rollouts (found by their indexed snapshot key),
every attempt, and spans counted per family."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dagster.types import Rollout, RolloutKind

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import Receipt
    from lightning_dagster.store import Store


def first_batch(store: Store, key: str, receipt: Receipt) -> list[Rollout]:
    """The train rollouts sampled from the exact parent (later RL steps are served by the candidate)."""
    parent = receipt.plan.parent.resource_id
    rollouts = store.query_rollouts(snapshot_key=key, kind=RolloutKind.train)
    return [r for r in rollouts if r.resource_id == parent]


def with_rollout_evidence(store: Store, receipt: Receipt, rollouts: list[Rollout]) -> Receipt:
    """The receipt with phase 2 rebuilt over these rollouts, every attempt and every span."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.types import span_family

    ids = [r.rollout_id for r in rollouts]
    attempts = store.list_attempts(rollout_ids=ids) if ids else []
    spans = store.list_spans(rollout_ids=ids) if ids else []
    pairs = ((s.rollout_id, span_family(s.kind.value, s.name, s.attributes)) for s in spans)
    return R.add_rollout_evidence(receipt, rollouts, attempts, pairs)
