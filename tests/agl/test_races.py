"""Agent Lightning's surface under races and reordering: a delete against cached attempts and lookups under
way, a pause against calls still arriving, and concurrent pause/resume against what the store keeps."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anyio
import pytest

from lightning_dagster.gateway.agl import Agl, AglSettings
from lightning_dagster.store import Store
from lightning_dagster.store import agl_rollouts as store_agl
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
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 200
    spans = len(agl.store.list_spans(attempt_id=attempt.attempt_id))
    assert agl.api.delete("/api/rollouts/r1").status_code == 204
    for path, body in (("/api/rollouts/r1/attempt/0/events", EVENT), (agl.proxy("r1"), CHAT)):
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
    real = store_agl.named_attempt

    def slow(*args):
        found = real(*args)
        read.set()
        assert release.wait(10)
        return found

    monkeypatch.setattr(store_agl, "named_attempt", slow)

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


def test_a_call_whose_body_arrives_after_a_pause_is_refused_and_never_reaches_the_upstream(agl):
    """The pause was checked before the call's body was read: a call whose body was still arriving when
    the pause came was sent upstream, uncounted in the `inflight` the pause reported (0)."""
    agl.create({"input": 1, "rollout_id": "r1"})
    body = json.dumps(CHAT).encode()
    host, port = agl.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = (
            f"POST {agl.proxy('r1')} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body[:5])
        deadline = time.monotonic() + 10  # the attempt is looked up before the body is read
        while not agl.store.list_attempts(rollout_id="r1") and time.monotonic() < deadline:
            time.sleep(0.01)
        paused = agl.api.post("/proxy/pause", json={"reason": "weights"}).json()
        assert paused["paused"] and paused["inflight"] == 0
        sock.sendall(body[5:])
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 429"), answer
    (attempt,) = agl.store.list_attempts(rollout_id="r1")
    assert agl.store.list_spans(attempt_id=attempt.attempt_id) == []
    assert agl.api.post("/proxy/resume").status_code == 200
    assert agl.api.post(agl.proxy("r1"), json=CHAT).status_code == 200


def test_concurrent_pause_and_resume_leave_the_store_in_the_state_the_server_serves(agl, monkeypatch):
    """Each change wrote the store from a worker thread without ordering: a pause whose write was slow,
    overtaken by a resume, left the store paused while the server served (after a restart: paused)."""
    real, first, release = agl.store.set_flag, threading.Event(), threading.Event()

    def set_flag(key, value):
        if key == "agl.proxy" and not first.is_set():  # the pause's write is slow
            first.set()
            assert release.wait(10)
        return real(key, value)

    monkeypatch.setattr(agl.store, "set_flag", set_flag)
    with ThreadPoolExecutor(2) as pool:
        pausing = pool.submit(agl.api.post, "/proxy/pause", json={"reason": "weights"})
        assert first.wait(10)
        resuming = pool.submit(agl.api.post, "/proxy/resume")
        concurrent.futures.wait([resuming], timeout=0.5)  # without ordering the resume is done by now
        release.set()
        assert pausing.result().status_code == resuming.result().status_code == 200
    served = agl.api.get("/proxy/state").json()
    assert served["paused"] is False
    assert agl.store.get_flag("agl.proxy")["paused"] is served["paused"]
