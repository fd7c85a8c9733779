"""Agent Lightning's surface under races and reordering: a delete against cached attempts and lookups under
way, a pause against calls still arriving, and concurrent pause/resume against what the store keeps."""

from __future__ import annotations

import asyncio
import threading

import anyio
import pytest

from lightning_dagster.gateway.agl import Agl, AglSettings
from lightning_dagster.store import Store
from lightning_dagster.store import agl as store_agl
from lightning_dagster.store.errors import NotFound
from tests.agl.conftest import KEY, SECRET

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EVENT = {"event_type": "note", "data": {}}


def test_a_deleted_rollout_takes_no_more_events_or_proxied_calls(agl):
    """The attempts a path names are cached per rollout: a delete left them there, so events and proxied
    calls to a deleted rollout kept landing (200, spans written) while its other routes answered 404."""
    agl.create({"input": 1, "rollout_id": "r1"})
    assert agl.api.post("/api/rollouts/r1/attempt/0/events", json=EVENT).status_code == 200
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    by_id = f"/api/rollouts/r1/attempt/{attempt.attempt_id}/events"
    assert agl.api.post(by_id, json=EVENT).status_code == 200
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 200
    spans = len(agl.store.list_spans(attempt_id=attempt.attempt_id))
    assert agl.api.delete("/api/rollouts/r1").status_code == 204
    for path, body in (("/api/rollouts/r1/attempt/0/events", EVENT), (by_id, EVENT), (agl.proxy("r1"), CHAT)):
        refused = agl.api.post(path, json=body)
        assert refused.status_code == 404, (path, refused.text)
    assert len(agl.store.list_spans(attempt_id=attempt.attempt_id)) == spans


def test_a_lookup_under_way_when_its_rollout_is_deleted_is_not_cached(tmp_path, monkeypatch):
    """A lookup that read the rollout before a delete finishes after it: its request is answered (it came
    first), but what it found is not cached for the requests after the delete."""
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    store_agl.create(store, [store_agl.new_rollout("r1", {"input": 1}, {})])
    agl = Agl(AglSettings(KEY), SECRET)
    read, release = threading.Event(), threading.Event()
    real = store_agl.current_attempt

    def slow(*args):
        found = real(*args)
        read.set()
        assert release.wait(10)
        return found

    monkeypatch.setattr(store_agl, "current_attempt", slow)

    async def main() -> None:
        lookup = asyncio.create_task(agl.target(store, "r1", "0"))
        assert await anyio.to_thread.run_sync(read.wait, 10)
        store_agl.delete(store, "r1")
        agl.moved("r1")
        release.set()
        assert (await lookup).attempt_id == store.list_attempts(rollout_id="r1")[0].attempt_id
        monkeypatch.undo()
        with pytest.raises(NotFound):
            await agl.target(store, "r1", "0")

    try:
        asyncio.run(main())
    finally:
        store.close()
