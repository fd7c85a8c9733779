"""Attribution, keys, limits and error handling at the HTTP edge; rewards, events and serve mode. Every
test runs on a SQLite file and on a real PostgreSQL server: bad input gets the same 4xx on both."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from lightning_dagster.gateway import EngineBackend, attempt_key
from lightning_dagster.gateway.keys import parse_attempt_key
from lightning_dagster.store import Store
from lightning_dagster.types import AttemptState
from tests.gateway.conftest import ADMIN, SECRET, SERVE, SERVE2, Gateway, _serve

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 1}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):
    """Overrides the gateway's SQLite store: each test here runs on both stores."""
    url = f"sqlite:///{tmp_path / 'store.db'}"
    s = Store(request.getfixturevalue("postgres_url") if request.param == "postgres" else url)
    yield s
    s.close()


def post(
    gw, path: str, key: str, json=None, content: bytes | None = None, headers: dict | None = None
) -> httpx.Response:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    headers = {"content-type": "application/json", **auth, **(headers or {})}
    return httpx.post(gw.url + path, headers=headers, json=json, content=content, timeout=60)


def test_attempt_keys_are_signed_and_bound_to_their_ids():
    key = attempt_key(SECRET, "ro-1", "at-1")
    assert parse_attempt_key(SECRET, key) == ("ro-1", "at-1")
    assert parse_attempt_key("other-secret", key) is None
    forged = key.replace(key.split(".")[2], attempt_key(SECRET, "ro-1", "at-2").split(".")[2])
    assert parse_attempt_key(SECRET, forged) is None


def test_a_key_cannot_write_another_attempts_spans_or_rewards(gateway):
    rid_a, aid_a, key_a = gateway.attempt()
    rid_b, aid_b, key_b = gateway.attempt()
    assert post(gateway, "/v1/chat/completions", key_a, CHAT).status_code == 200
    refused = [
        post(gateway, f"/rollouts/{rid_b}/attempts/{aid_b}/v1/chat/completions", key_a, CHAT),
        post(gateway, f"/rollouts/{rid_b}/attempts/{aid_b}/v1/rewards", key_a, {"value": 1.0}),
        post(gateway, "/v1/rewards", key_a, {"value": 1.0, "rollout_id": rid_b}),
        post(
            gateway,
            f"/api/rollouts/{rid_b}/attempt/{aid_b}/events",
            key_a,
            {"event_type": "reward", "data": {"value": 1}},
        ),
        post(gateway, f"/rollouts/{rid_b}/attempts/{aid_b}/v1/chat/completions", SERVE, CHAT),
    ]
    assert [r.status_code for r in refused] == [403] * 5
    assert "another attempt" in refused[0].json()["error"]["message"]
    assert gateway.spans(aid_b, kind=None) == [] and gateway.store.list_rewards(rollout_ids=[rid_b]) == []
    # the path form works with the attempt's own key, and with the admin key
    assert (
        post(gateway, f"/rollouts/{rid_b}/attempts/{aid_b}/v1/chat/completions", key_b, CHAT).status_code
        == 200
    )
    assert (
        post(gateway, f"/rollouts/{rid_b}/attempts/{aid_b}/v1/chat/completions", ADMIN, CHAT).status_code
        == 200
    )
    assert len(gateway.spans(aid_b)) == 2 and len(gateway.spans(aid_a)) == 1


def test_bad_requests_get_4xx_with_a_message_and_keep_earlier_spans(small_gateway):
    gw = small_gateway
    rid, aid, key = gw.attempt()
    assert post(gw, "/v1/chat/completions", key, CHAT).status_code == 200
    before = gw.spans(aid)
    cases = {
        "malformed": post(gw, "/v1/chat/completions", key, content=b'{"messages": [}'),
        "not an object": post(gw, "/v1/chat/completions", key, [1, 2]),
        "wrong type": post(gw, "/v1/chat/completions", key, {**CHAT, "temperature": "hot"}),
        "bad role": post(
            gw, "/v1/chat/completions", key, {**CHAT, "messages": [{"role": "robot", "content": "x"}]}
        ),
        "n=2": post(gw, "/v1/chat/completions", key, {**CHAT, "n": 2}),
        "oversized": post(gw, "/v1/chat/completions", key, {**CHAT, "pad": "x" * 5000}),
        "unknown attempt": post(gw, "/v1/chat/completions", attempt_key(SECRET, rid, "at-nope"), CHAT),
        "unknown rollout": post(gw, "/rollouts/ro-nope/attempts/at-nope/v1/chat/completions", ADMIN, CHAT),
        "no key": post(gw, "/v1/chat/completions", "", CHAT),
        "bad key": post(gw, "/v1/chat/completions", "ld1.x.y.z", CHAT),
        "reward not a number": post(gw, "/v1/rewards", key, {"value": "high"}),
        "admin route": httpx.get(gw.url + "/admin/stats", headers={"Authorization": f"Bearer {key}"}),
    }
    codes = {name: r.status_code for name, r in cases.items()}
    assert codes == {
        "malformed": 400,
        "not an object": 400,
        "wrong type": 422,
        "bad role": 422,
        "n=2": 422,
        "oversized": 413,
        "unknown attempt": 404,
        "unknown rollout": 404,
        "no key": 401,
        "bad key": 401,
        "reward not a number": 422,
        "admin route": 403,
    }
    messages = {name: r.json()["error"]["message"] for name, r in cases.items()}
    assert messages["wrong type"].startswith("temperature:")
    assert messages["bad role"].startswith("messages.0.role:")
    assert messages["n=2"].startswith("n:") and "n=1" in messages["n=2"]
    assert messages["reward not a number"].startswith("value:")
    assert "2048" in messages["oversized"]
    assert gw.spans(aid) == before
    assert post(gw, "/v1/chat/completions", key, CHAT).status_code == 200  # still serving
    assert gw.spans(aid)[0] == before[0] and len(gw.spans(aid)) == 2


def test_an_attempt_that_is_not_running_is_refused_with_409(gateway):
    _, aid, key = gateway.attempt()
    client = gateway.client(key)
    client.chat.completions.create(**CHAT)
    gateway.store.transition_attempt(aid, AttemptState.succeeded, reason_code="ok")
    with pytest.raises(openai.ConflictError, match="not running"):
        client.chat.completions.create(**CHAT)
    assert len(gateway.spans(aid)) == 1


def test_rewards_and_agent_lightning_events_land_with_their_attempt(gateway):
    rid, aid, key = gateway.attempt()
    assert post(gateway, "/v1/rewards", key, {"value": 0.5, "judge": "exact"}).status_code == 200
    event = {"event_type": "reward", "data": {"value": 1.0, "source": "agent"}}
    assert post(gateway, "/v1/events", key, event).status_code == 200
    assert post(gateway, f"/api/rollouts/{rid}/attempt/{aid}/events", key, event).status_code == 200
    assert (
        post(gateway, "/v1/events", key, {"event_type": "tool_call", "data": {"name": "calc"}}).status_code
        == 200
    )
    assert post(gateway, "/v1/events", key, {"event_type": "reward", "data": {}}).status_code == 422
    rewards = gateway.store.list_rewards(rollout_ids=[rid])
    assert [(r.value, r.judge, r.attempt_id) for r in rewards] == [
        (0.5, "exact", aid),
        (1.0, "harness", aid),
        (1.0, "harness", aid),
    ]
    spans = gateway.spans(aid, kind=None)
    assert [s.kind.value for s in spans] == ["reward", "reward", "reward", "custom"]
    assert spans[1].attributes["source"] == "agent" and spans[3].name == "tool_call"
    assert [s.sequence for s in spans] == [0, 1, 2, 3]


def test_a_reward_integer_too_large_for_a_float_is_a_422_bad_reward_at_every_route(gateway):
    rid, aid, key = gateway.attempt()
    huge = 10**400  # valid JSON; past a float's range
    answers = [
        post(gateway, "/v1/rewards", key, {"value": huge}),
        post(gateway, "/v1/rewards", key, {"value": 0.5, "uncertainty": -huge}),
        post(gateway, "/v1/events", key, {"event_type": "reward", "data": {"value": huge}}),
        post(gateway, f"/api/rollouts/{rid}/attempt/{aid}/events", key,
             {"event_type": "reward", "data": {"value": huge}}),
    ]  # fmt: skip
    for answer, field in zip(answers, ["value", "uncertainty", "data.value", "data.value"], strict=True):
        assert answer.status_code == 422, answer.text
        error = answer.json()["error"]
        assert error["code"] == "bad_reward" and error["param"] == field
        assert error["message"] == f"{field}: an integer too large for a float (beyond about 1.8e308); " \
            "expected a finite number"  # fmt: skip
    assert gateway.store.list_rewards(rollout_ids=[rid]) == []
    # the attempt is still usable: a proper reward lands
    assert post(gateway, "/v1/rewards", key, {"value": 1}).status_code == 200
    assert [r.value for r in gateway.store.list_rewards(rollout_ids=[rid])] == [1.0]


def test_serve_key_creates_a_serve_rollout_per_session_and_takes_late_rewards(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=SERVE, max_retries=0)
    headers = {"X-Session-Id": "session-1"}
    r1 = client.chat.completions.with_raw_response.create(**CHAT, extra_headers=headers)
    r2 = client.chat.completions.with_raw_response.create(**CHAT, extra_headers=headers)
    r3 = client.chat.completions.with_raw_response.create(
        **{**CHAT, "messages": [{"role": "user", "content": "other"}]}
    )
    rid = r1.headers["x-ld-rollout-id"]
    assert r2.headers["x-ld-rollout-id"] == rid != r3.headers["x-ld-rollout-id"]
    assert r1.headers["x-session-id"] == "session-1"
    rollout = gateway.store.get_rollout(rid)
    assert rollout.kind.value == "serve"
    assert len(gateway.store.list_spans(rollout_id=rid, kind="llm")) == 2
    assert post(gateway, "/v1/rewards", SERVE, {"rollout_id": rid, "value": 0.25}).status_code == 200
    assert [r.value for r in gateway.store.list_rewards(rollout_ids=[rid])] == [0.25]
    # a serve key cannot reward a training rollout
    train_rid, _, _ = gateway.attempt()
    assert post(gateway, "/v1/rewards", SERVE, {"rollout_id": train_rid, "value": 1}).status_code == 403


def test_serve_clients_are_never_merged_by_content_and_sessions_belong_to_their_key(gateway):
    one = openai.OpenAI(base_url=gateway.url + "/v1", api_key=SERVE, max_retries=0)
    other = openai.OpenAI(base_url=gateway.url + "/v1", api_key=SERVE2, max_retries=0)
    a = one.chat.completions.with_raw_response.create(**CHAT)  # same first message, no X-Session-Id
    b = one.chat.completions.with_raw_response.create(**CHAT)
    assert a.headers["x-ld-rollout-id"] != b.headers["x-ld-rollout-id"]
    # the session id a response returns continues that session, for the key that opened it only
    session = {"X-Session-Id": a.headers["x-session-id"]}
    again = one.chat.completions.with_raw_response.create(**CHAT, extra_headers=session)
    assert again.headers["x-ld-rollout-id"] == a.headers["x-ld-rollout-id"]
    with pytest.raises(openai.PermissionDeniedError, match="another serve key") as refused:
        other.chat.completions.create(**CHAT, extra_headers=session)
    assert refused.value.code == "wrong_session"
    assert len(gateway.store.list_spans(rollout_id=a.headers["x-ld-rollout-id"], kind="llm")) == 2
    too_long = post(gateway, "/v1/chat/completions", SERVE, CHAT, headers={"X-Session-Id": "s" * 257})
    assert too_long.status_code == 422 and too_long.json()["error"]["param"] == "X-Session-Id"


def test_an_unmodified_agent_is_served_under_any_model_name_it_sends_and_the_name_is_recorded(gateway):
    _, aid, key = gateway.attempt()
    for name in ("default", "gpt-4o", "policy"):
        reply = gateway.client(key).chat.completions.create(**{**CHAT, "model": name})
        assert reply.choices[0].message is not None
    assert [s.attributes["requested_model"] for s in gateway.spans(aid)] == ["default", "gpt-4o", "policy"]
    assert {s.attributes["model"] for s in gateway.spans(aid)} == {"res-base"}  # the policy served each


def test_with_model_names_set_any_other_name_is_a_404_naming_the_setting(store, batching):
    with _serve(store, EngineBackend(batching, resource_id="res-base"), model_names=["policy"]) as server:
        gateway = Gateway(server, store, server.url)
        _, aid, key = gateway.attempt()
        with pytest.raises(openai.NotFoundError) as refused:
            gateway.client(key).chat.completions.create(**{**CHAT, "model": "gpt-4o"})
        error = refused.value.body
        assert (error["code"], error["type"], error["param"]) == (
            "model_not_found",
            "invalid_request_error",
            "model",
        )
        assert "`gpt-4o`" in error["message"] and "model_names" in error["message"]
        assert "allows only res-base, policy" in error["message"] and gateway.spans(aid, kind=None) == []
        for name in ("policy", "res-base"):  # the listed name and the served model's own name
            gateway.client(key).chat.completions.create(**{**CHAT, "model": name})
        assert len(gateway.spans(aid)) == 2


BAD_INPUT = {
    # name: (path, body or raw bytes, extra headers, field the error names)
    "NaN in event data": ("/v1/events", b'{"event_type": "note", "data": {"x": [1, NaN]}}', {}, "data.x.1"),
    "Infinity reward": ("/v1/rewards", b'{"value": Infinity}', {}, "value"),
    "NaN note of a reward": ("/v1/rewards", b'{"value": 1.0, "note": NaN}', {}, "note"),
    "NUL in event data": ("/v1/events", {"event_type": "note", "data": {"x": "a\x00b"}}, {}, "data.x"),
    "NUL in an event type": ("/v1/events", {"event_type": "no\x00te"}, {}, "event_type"),
    "NUL in a data key": ("/v1/events", {"event_type": "note", "data": {"k\x00": 1}}, {}, "data"),
    "event_type of 257": ("/v1/events", {"event_type": "e" * 257}, {}, "event_type"),
    "judge of 129": ("/v1/rewards", {"value": 1, "judge": "j" * 129}, {}, "judge"),
    "event judge of 129": (
        "/v1/events",
        {"event_type": "reward", "data": {"value": 1, "judge": "j" * 129}},
        {},
        "data.judge",
    ),  # fmt: skip
    "reward true": ("/v1/rewards", {"value": True}, {}, "value"),
    "reward string": ("/v1/rewards", {"value": "0.5"}, {}, "value"),
    "event reward string": (
        "/v1/events",
        {"event_type": "reward", "data": {"value": "0.5"}},
        {},
        "data.value",
    ),
    "uncertainty true": ("/v1/rewards", {"value": 1, "uncertainty": True}, {}, "uncertainty"),
    "request id of 257": ("/v1/rewards", {"value": 1}, {"Idempotency-Key": "k" * 257}, "idempotency-key"),
    "NaN in a chat message": (
        "/v1/chat/completions",
        b'{"model": "policy", "messages": [{"role": "user", "content": "hi", "w": NaN}]}',
        {},
        "messages.0.w",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_a_4xx_naming_the_field_and_writes_nothing_on_either_store(gateway, case):
    rid, aid, key = gateway.attempt()
    path, body, headers, field = BAD_INPUT[case]
    raw = body if isinstance(body, bytes) else None
    r = post(gateway, path, key, None if raw else body, content=raw, headers=headers)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}:")
    assert gateway.spans(aid, kind=None) == [] and gateway.store.list_rewards(rollout_id=rid) == []
    assert post(gateway, "/v1/rewards", key, {"value": 0.5}).status_code == 200  # the attempt still works


def test_a_retried_reward_is_stored_once_with_its_span(gateway):
    rid, aid, key = gateway.attempt()
    retry = {"Idempotency-Key": "reward-1"}
    first = post(gateway, "/v1/rewards", key, {"value": 0.75, "judge": "exact"}, headers=retry)
    second = post(gateway, "/v1/rewards", key, {"value": 0.75, "judge": "exact"}, headers=retry)
    assert first.status_code == second.status_code == 200
    assert first.json()["span_id"] == second.json()["span_id"]
    # Agent Lightning's event route and X-Request-Id take the same path
    event = {"event_type": "reward", "data": {"value": 1.0}}
    assert post(gateway, "/v1/events", key, event, headers={"X-Request-Id": "r-2"}).status_code == 200
    assert post(gateway, "/v1/events", key, event, headers={"X-Request-Id": "r-2"}).status_code == 200
    rewards = gateway.store.list_rewards(rollout_id=rid)
    assert [(r.value, r.judge) for r in rewards] == [(0.75, "exact"), (1.0, "harness")]
    spans = gateway.spans(aid, kind="reward")
    assert [s.span_id for s in spans][0] == first.json()["span_id"] and len(spans) == 2
    assert spans[0].attributes["request_id"] == "reward-1"
    reused = post(gateway, "/v1/rewards", key, {"value": 0.1}, headers=retry)
    assert reused.status_code == 409 and "reward-1" in reused.json()["error"]["message"]
    assert len(gateway.store.list_rewards(rollout_id=rid)) == 2


def test_a_500_leaves_no_committed_write_and_the_retry_stores_the_reward_once(gateway, monkeypatch):
    rid, aid, key = gateway.attempt()

    def fail_after_the_reward_row(c, rows):
        raise RuntimeError("injected failure after the reward row was written")

    with monkeypatch.context() as patch:
        patch.setattr(gateway.store, "_insert_spans", fail_after_the_reward_row)
        failed = post(gateway, "/v1/rewards", key, {"value": 1.0}, headers={"Idempotency-Key": "k-1"})
    assert failed.status_code == 500
    assert gateway.store.list_rewards(rollout_id=rid) == [] and gateway.spans(aid, kind=None) == []
    for _ in range(2):  # the client's retries
        assert post(
            gateway, "/v1/rewards", key, {"value": 1.0}, headers={"Idempotency-Key": "k-1"}
        ).is_success
    (reward,) = gateway.store.list_rewards(rollout_id=rid)
    (span,) = gateway.spans(aid, kind=None)
    assert (reward.value, span.kind.value, span.attributes["value"]) == (1.0, "reward", 1.0)


def test_keys_never_appear_in_logs(gateway, caplog):
    caplog.set_level(logging.DEBUG)
    _, aid, key = gateway.attempt()
    post(gateway, "/v1/chat/completions", key, CHAT)
    post(gateway, "/v1/chat/completions", key, {**CHAT, "temperature": "x"})
    post(gateway, "/v1/chat/completions", key + "tampered", CHAT)
    post(gateway, "/v1/chat/completions", SERVE + "x", CHAT)
    httpx.get(gateway.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}x"})
    assert "invalid API key" in caplog.text  # the rejections were logged ...
    for secret in (key, SERVE, ADMIN, SECRET, key.split(".")[-1]):
        assert secret not in caplog.text  # ... without the keys


def test_admin_routes_need_the_admin_key(gateway):
    _, aid, key = gateway.attempt()
    post(gateway, "/v1/chat/completions", key, CHAT)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(gateway.url + "/admin/health", headers=auth).json()["status"] == "ok"
    spans = httpx.get(f"{gateway.url}/admin/attempts/{aid}/spans", headers=auth).json()
    assert len(spans) == 1 and spans[0]["attempt_id"] == aid
    minted = post(gateway, "/admin/keys", ADMIN, {"rollout_id": "ro-x", "attempt_id": "at-y"}).json()["key"]
    assert parse_attempt_key(SECRET, minted) == ("ro-x", "at-y")
    assert httpx.get(gateway.url + "/admin/health").status_code == 401
    models = gateway.client(key).models.list()
    assert [m.id for m in models.data] == ["res-base"]  # the model's own name (any other is served too)
