"""Several upstreams: sticky routing per rollout, failover when one stops or answers 5xx (a 4xx is the
answer), run-time add/remove; and token-in enforced upstream, checked by a stub that refuses any token-id
prompt other than the exact ids it expects."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from lightning_dagster.gateway import (
    GatewayKeys,
    GatewayServer,
    UpstreamBackend,
    UpstreamPool,
    create_app,
)
from lightning_dagster.gateway.upstreams import upstream_urls
from tests.gateway.conftest import ADMIN, SECRET, Gateway
from tests.support.stub_upstream import TOOL_PROMPT, StubCodec, _ids, create_stub_app, decode


def _gateway(store, backend) -> GatewayServer:
    return GatewayServer(create_app(store, backend, keys=GatewayKeys(SECRET, ADMIN)))


def _turns(gw: Gateway, attempts: list, n: int) -> None:
    """`n` more chat turns for every attempt, all attempts at once; any failed call fails the test."""
    errors: list[BaseException] = []

    def run(key: str, i: int) -> None:
        try:
            client = gw.client(key)
            for turn in range(n):
                messages = [{"role": "user", "content": f"rollout {i} turn {turn}"}]
                client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(key, i)) for i, (_, _, key) in enumerate(attempts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _served(gw: Gateway, aid: str) -> list[str]:
    return [s.attributes["upstream"] for s in gw.spans(aid) if s.status != "error"]


def test_rollouts_stick_to_one_upstream_and_move_for_good_when_it_stops(store):
    stubs = [GatewayServer(create_stub_app(reply_tokens=4)).start() for _ in range(2)]
    urls = [s.url + "/v1" for s in stubs]
    backend = UpstreamBackend([s.url for s in stubs], cooldown_s=0.3)
    try:
        with _gateway(store, backend) as server:
            gw = Gateway(server, store, server.url)
            attempts = [gw.attempt() for _ in range(16)]
            _turns(gw, attempts, 2)
            first = {aid: _served(gw, aid) for _, aid, _ in attempts}
            assert all(len(set(s)) == 1 for s in first.values())  # sticky per rollout
            assert {s[0] for s in first.values()} == set(urls)  # and both upstreams serve
            port = stubs[0].port
            stubs[0].stop()  # mid-run: these rollouts have more turns to go
            _turns(gw, attempts, 2)
            for _, aid, _ in attempts:
                before = first[aid][0]
                assert _served(gw, aid) == [before] * 2 + [urls[1]] * 2  # every call served, none lost
                assert all(s.status == "ok" for s in gw.spans(aid))
            stubs[0] = GatewayServer(create_stub_app(reply_tokens=4), port=port).start()
            threading.Event().wait(0.4)  # the cool-down is over: the stub is back in the pool
            _turns(gw, attempts, 1)
            assert all(_served(gw, aid)[-1] == urls[1] for _, aid, _ in attempts)  # moved ones stay
            fresh = [gw.attempt() for _ in range(16)]
            _turns(gw, fresh, 1)
            assert urls[0] in {_served(gw, aid)[0] for _, aid, _ in fresh}  # it serves new rollouts again
            for _, _, key in [*attempts, *fresh]:
                reward = httpx.post(
                    gw.url + "/v1/rewards", json={"value": 1.0}, headers={"Authorization": f"Bearer {key}"}
                )
                assert reward.status_code == 200
            assert store.count_spans(kind="llm") == 16 * 5 + 16
    finally:
        for stub in stubs:
            stub.stop()


def test_a_5xx_fails_over_but_a_4xx_is_the_answer(store):
    stubs = [GatewayServer(create_stub_app(reply_tokens=4)).start() for _ in range(2)]
    by_url = {s.url + "/v1": s for s in stubs}
    try:
        with _gateway(store, UpstreamBackend([s.url for s in stubs])) as server:
            gw = Gateway(server, store, server.url)
            _, aid, key = gw.attempt()
            client = gw.client(key)
            messages = [{"role": "user", "content": "hi"}]
            client.chat.completions.create(model="policy", messages=messages)
            (home,) = _served(gw, aid)
            other = next(s for u, s in by_url.items() if u != home)
            by_url[home].app.state.fail_status = 400
            with pytest.raises(openai.BadRequestError, match="stub told to fail"):
                client.chat.completions.create(model="policy", messages=messages)
            assert other.app.state.calls["chat"] == 0
            refused = gw.spans(aid)[-1]  # the refused call is on the record with the upstream's status
            assert refused.status == "error" and refused.attributes["http_status"] == 400
            by_url[home].app.state.fail_status = 503
            client.chat.completions.create(model="policy", messages=messages)
            assert _served(gw, aid)[-1] == other.url + "/v1" and other.app.state.calls["chat"] == 1
    finally:
        for stub in stubs:
            stub.stop()


def test_upstreams_added_and_removed_at_run_time_take_and_stop_taking_routes():
    pool = UpstreamPool("http://a:1, http://b:1/v1")
    assert pool.urls == ["http://a:1/v1", "http://b:1/v1"]
    routes = [f"rollout-{i}" for i in range(64)]
    pool.add("http://c:1")
    first = {r: pool.candidates(r)[0].url for r in routes}
    assert set(first.values()) == set(pool.urls)
    pool.remove("http://c:1")
    moved = {r for r in routes if pool.candidates(r)[0].url != first[r]}
    assert moved == {r for r in routes if first[r] == "http://c:1/v1"}  # only its routes move
    with pytest.raises(KeyError, match="not an upstream"):
        pool.remove("http://c:1")
    with pytest.raises(ValueError, match="no upstream URL"):
        upstream_urls(" , ")


def test_token_in_sends_the_exact_ids_upstream_as_a_token_id_prompt(store):
    stub = GatewayServer(create_stub_app(reply_tokens=12, check_token_ids=True)).start()
    try:
        with _gateway(store, UpstreamBackend(stub.url, codec=StubCodec())) as server:
            gw = Gateway(server, store, server.url)
            _, aid, key = gw.attempt()
            client = gw.client(key)
            messages = [{"role": "system", "content": "You add."}, {"role": "user", "content": "2+2?"}]
            first = client.chat.completions.create(model="policy", messages=messages)
            messages += [first.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "user", "content": TOOL_PROMPT}]
            called = client.chat.completions.create(model="policy", messages=messages)
            (call,) = called.choices[0].message.tool_calls
            assert (call.function.name, call.function.arguments) == ("now", '{"zone": "utc"}')
            assert called.choices[0].finish_reason == "tool_calls"
            messages += [called.choices[0].message.model_dump(exclude_none=True)]
            messages += [{"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
            client.chat.completions.create(model="policy", messages=messages)
        spans = gw.spans(aid)
        assert [s.attributes["token_source"] for s in spans] == ["rendered", "reused", "reused"]
        assert [s.attributes["token_in"] for s in spans] == [False, True, True]
        # the sampled ids do not survive decode + encode: only reused ids could have passed the stub
        assert spans[1].response_token_ids != _ids(decode(spans[1].response_token_ids))
        assert stub.app.state.mismatches == [] and stub.app.state.calls == {"completions": 3}
        rerendered = _ids(decode(spans[2].prompt_token_ids))
        loud = httpx.post(stub.url + "/v1/completions", json={"prompt": rerendered, "max_tokens": 2})
        assert loud.status_code == 400 and "token-id prompt mismatch" in loud.text
    finally:
        stub.stop()


@pytest.mark.parametrize(
    "url", ["ftp://host/v1", "file:///etc/passwd", "http://", "host:8000", "http://h/v1?x=1", "http://h:port"]
)
def test_an_upstream_that_is_not_an_http_url_is_refused_naming_it(url, capsys):
    with pytest.raises(ValueError, match="not an http|not a valid URL|base URL"):
        upstream_urls(url)
    from lightning_dagster.cli import main

    assert main(["gateway", "serve", "--upstream-url", url, "--port", "0"]) == 2  # before anything starts
    assert "error: gateway serve: --upstream-url:" in capsys.readouterr().err
    assert upstream_urls("https://h:8443/base, http://[::1]:9") == [
        "https://h:8443/base/v1",
        "http://[::1]:9/v1",
    ]
