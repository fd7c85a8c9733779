"""Agent Lightning's surface on gateway replicas: two gateways (each its own app, store connection and caches)
over one PostgreSQL database. A delete or a lifecycle move through one must be seen by the other at its next
event or proxied call, answered as the gateway that made the change answers it, and nothing either accepted
is lost. And on one gateway over a SQLite file, a move or delete is seen at once by the contexts it keeps for
calls by attempt key and within `state_ttl_s`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

from lightning_dagster.gateway import (
    GatewayKeys,
    GatewayOptions,
    GatewayServer,
    UpstreamBackend,
    attempt_key,
    create_app,
)
from lightning_dagster.store import Store
from tests.agl.conftest import ADMIN, KEY, SECRET

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
EVENT = {"event_type": "note", "data": {}}
REWARD = {"event_type": "reward", "data": {"value": 1.0}}


@dataclass
class Replica:
    url: str
    store: Store
    api: httpx.Client

    def proxy(self, rollout_id: str, attempt_id: str = "0") -> httpx.Response:
        path = f"/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/train/openai/v1/chat/completions"
        return self.api.post(path, json=CHAT)

    def event(self, rollout_id: str, body: dict = EVENT, attempt_id: str = "0") -> httpx.Response:
        return self.api.post(f"/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", json=body)


def _gateway(stack: ExitStack, url: str, stub, state_ttl_s: float = 0.0) -> Replica:
    store = Store(url)
    stack.callback(store.close)
    backend = UpstreamBackend(stub.url, model="stub-model")
    keys = GatewayKeys(SECRET, ADMIN, agl_key=KEY)
    app = create_app(store, backend, keys=keys, options=GatewayOptions(state_ttl_s=state_ttl_s))
    server = stack.enter_context(GatewayServer(app))
    headers = {"Authorization": f"Bearer {KEY}"}
    api = stack.enter_context(httpx.Client(base_url=server.url, headers=headers, timeout=30))
    return Replica(server.url, store, api)


@pytest.fixture
def replicas(postgres_url, stub) -> Iterator[tuple[Replica, Replica]]:
    # state_ttl_s as a deployment sets it: over PostgreSQL it plays no part (every call re-reads)
    with ExitStack() as stack:
        yield _gateway(stack, postgres_url, stub, 0.5), _gateway(stack, postgres_url, stub, 0.5)


def _spans(store: Store, rollout_id: str) -> list:
    return store.list_spans(rollout_id=rollout_id)


def _answer(r: httpx.Response) -> tuple[int, dict]:
    return r.status_code, r.json()


@pytest.mark.postgres
def test_a_rollout_deleted_through_one_replica_takes_no_events_or_proxied_calls_through_another(replicas):
    """Each replica caches a rollout's attempts with no expiry: a delete through A left B's entries, so B
    kept taking events and proxied calls for the deleted rollout (200, spans written)."""
    a, b = replicas
    two = [{"input": 1, "rollout_id": "r1"}, {"input": 2, "rollout_id": "r2"}]
    assert a.api.post("/api/rollouts", json=two).status_code == 201
    for rid in ("r1", "r2"):  # both replicas resolve and cache the attempt by its name, `0`
        for replica in (a, b):
            assert replica.event(rid).status_code == 200
            assert replica.proxy(rid).status_code == 200
    (attempt,) = b.store.list_attempts(rollout_id="r1")
    aid = attempt.attempt_id
    assert b.event("r1", attempt_id="0").status_code == 200
    accepted = _spans(b.store, "r1")
    assert len(accepted) == 5

    assert a.api.delete("/api/rollouts/r1").status_code == 204
    assert b.api.delete("/api/rollouts/r2").status_code == 204  # the single-gateway reference
    for call in (
        lambda g, rid: g.event(rid),
        lambda g, rid: g.event(rid, REWARD),
        lambda g, rid: g.proxy(rid),
    ):
        other, itself = call(b, "r1"), call(b, "r2")
        assert other.status_code == 404, other.text
        assert _answer(other) == (itself.status_code, json.loads(itself.text.replace("r2", "r1")))
        assert _answer(call(a, "r1")) == _answer(other)
    # calls by the attempt's own key, to the gateway's own routes, are refused too
    key = {"Authorization": f"Bearer {attempt_key(SECRET, 'r1', aid)}"}
    own = b.api.post(f"/rollouts/r1/attempts/{aid}/v1/chat/completions", json=CHAT, headers=key)
    assert own.status_code == 404, own.text
    assert (
        b.api.get("/api/rollouts/r1").status_code == b.api.get("/api/rollouts/r1/events").status_code == 404
    )
    assert _spans(a.store, "r1") == accepted  # nothing new, nothing accepted lost
    assert a.store.list_rewards(rollout_id="r1") == []


@pytest.mark.postgres
@pytest.mark.parametrize("state", ["succeeded", "failed"])
def test_a_rollout_finished_through_one_replica_is_answered_by_another_as_by_itself(replicas, state):
    """r1 ends through A, r2 through B: B answers both rollouts' later calls alike (proxied calls 409, the
    attempt is no longer running; events still land, as on one gateway), and every span stays."""
    a, b = replicas
    two = [{"input": 1, "rollout_id": "r1"}, {"input": 2, "rollout_id": "r2"}]
    assert a.api.post("/api/rollouts", json=two).status_code == 201
    for rid in ("r1", "r2"):
        assert a.api.patch(f"/api/rollouts/{rid}", json={"status": {"state": "running"}}).status_code == 200
        assert b.proxy(rid).status_code == b.event(rid).status_code == 200  # B caches the attempt
    before = {rid: _spans(a.store, rid) for rid in ("r1", "r2")}
    assert a.api.patch("/api/rollouts/r1", json={"status": {"state": state}}).status_code == 200
    assert b.api.patch("/api/rollouts/r2", json={"status": {"state": state}}).status_code == 200
    for call in (lambda rid: b.proxy(rid), lambda rid: b.event(rid), lambda rid: b.event(rid, REWARD)):
        other, itself = call("r1"), call("r2")
        assert other.status_code == itself.status_code, (other.text, itself.text)
        if other.status_code != 200:
            assert other.json()["error"]["code"] == itself.json()["error"]["code"]
    assert b.proxy("r1").status_code == 409
    assert b.proxy("r1").json()["error"]["code"] == "not_running"
    for rid in ("r1", "r2"):
        after = _spans(a.store, rid)
        assert after[: len(before[rid])] == before[rid]
        assert len(after) == len(before[rid]) + 2  # the note and the reward, as on one gateway
    assert b.api.get("/api/rollouts/r1").json()["rollout"]["status"]["state"] == state


@pytest.mark.postgres
def test_events_racing_a_delete_on_another_replica_are_each_stored_if_and_only_if_accepted(replicas):
    """Every event B answered 200 is stored (the check is at acceptance, so a span committed after the
    delete still lands), every one it refused is not, and once A's delete has answered B refuses all."""
    a, b = replicas
    a.api.post("/api/rollouts", json=[{"input": 1, "rollout_id": "r1"}])
    assert b.event("r1").status_code == 200
    answers: dict[int, int] = {}
    deleted = threading.Event()
    after_delete: list[int] = []

    def post() -> None:
        for i in range(200):
            done = deleted.is_set()
            status = b.event("r1", {"event_type": "note", "data": {"i": i}}).status_code
            answers[i] = status
            if done:
                after_delete.append(status)
            if len(after_delete) >= 10:
                return

    poster = threading.Thread(target=post)
    poster.start()
    while len(answers) < 20 and poster.is_alive():
        time.sleep(0.005)
    assert a.api.delete("/api/rollouts/r1").status_code == 204
    deleted.set()
    poster.join(60)
    assert set(answers.values()) <= {200, 404}
    assert after_delete and set(after_delete) == {404}
    stored = {s.attributes.get("i") for s in _spans(a.store, "r1") if s.name == "note"} - {None}
    assert stored == {i for i, status in answers.items() if status == 200}
    assert 20 <= len(stored) < len(answers)


@pytest.mark.parametrize("change", ["delete", "succeeded"])
def test_one_gateway_over_a_file_sees_its_own_delete_or_move_in_the_contexts_it_keeps(tmp_path, stub, change):
    """Over a SQLite file a cached context is not re-read per call: a delete left calls by the attempt's key
    writing to the deleted rollout, and a move to a final state left proxied calls running on for up to
    `state_ttl_s` (here a minute)."""
    with ExitStack() as stack:
        g = _gateway(stack, f"sqlite:///{tmp_path / 'store.db'}", stub, state_ttl_s=60.0)
        g.api.post("/api/rollouts", json=[{"input": 1, "rollout_id": "r1"}])
        assert g.proxy("r1").status_code == 200
        (attempt,) = g.store.list_attempts(rollout_id="r1")
        key = {"Authorization": f"Bearer {attempt_key(SECRET, 'r1', attempt.attempt_id)}"}
        own = f"/rollouts/r1/attempts/{attempt.attempt_id}/v1/chat/completions"
        assert g.api.post(own, json=CHAT, headers=key).status_code == 200
        accepted = _spans(g.store, "r1")
        if change == "delete":
            assert g.api.delete("/api/rollouts/r1").status_code == 204
            expected = 404
        else:
            assert g.api.patch("/api/rollouts/r1", json={"status": {"state": change}}).status_code == 200
            expected = 409
        assert g.proxy("r1").status_code == expected
        assert g.api.post(own, json=CHAT, headers=key).status_code == expected
        assert _spans(g.store, "r1") == accepted
