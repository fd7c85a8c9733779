"""The span writer's group commit against the real store."""

from __future__ import annotations

import asyncio

import pytest

from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.recorder import SpanWriter
from lightning_dagster.types import Rollout, Span, SpanKind


def test_one_bad_span_fails_alone_and_its_batch_mates_are_committed(store):
    (r,) = store.enqueue_rollouts([Rollout()])
    _, a = store.claim_rollout("w", rollout_ids=[r.rollout_id])
    writer = SpanWriter(store, linger_s=0.2)

    def span(i: int, attempt_id: str) -> Span:
        return Span(
            rollout_id=r.rollout_id, attempt_id=attempt_id, sequence=i, kind=SpanKind.custom, name=f"s{i}"
        )

    async def run():
        # queued together within the linger window: one transaction, which the unknown attempt makes fail
        await writer.write([span(0, a.attempt_id)], wait=False)
        bad = asyncio.create_task(writer.write([span(1, "at-unknown")]))
        good = asyncio.create_task(writer.write([span(2, a.attempt_id)]))
        with pytest.raises(GatewayError, match="'at-unknown' of rollout") as refused:
            await bad
        assert refused.value.status == 404  # the store's named error, not a bare 500
        await good

    asyncio.run(run())
    writer.close()
    assert [s.name for s in store.list_spans(attempt_id=a.attempt_id)] == ["s0", "s2"]
