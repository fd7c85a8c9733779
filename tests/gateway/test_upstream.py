"""Upstream mode against a stub returning vLLM-shaped JSON, and concurrent capture."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from lightning_dagster.gateway import GatewayKeys, GatewayOptions, GatewayServer, UpstreamBackend, create_app
from tests.gateway.conftest import ADMIN, SECRET, Gateway
from tests.support.stub_upstream import _ids, render, reply


def test_upstream_mode_records_the_upstream_ids_and_logprobs(upstream_gateway):
    gw = upstream_gateway
    _, aid, key = gw.attempt()
    client = gw.client(key)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+2?"}]
    for turn in range(3):
        resp = client.chat.completions.create(model="policy", messages=messages, logprobs=turn == 0)
        text = resp.choices[0].message.content
        assert text == reply(render(messages), 50)
        span = gw.spans(aid)[-1]
        assert span.prompt_token_ids == _ids(render(messages)) == resp.model_extra["prompt_token_ids"]
        assert span.response_token_ids == _ids(text) == resp.choices[0].model_extra["token_ids"]
        assert span.response_logprobs == [-((ord(c) % 7) / 8) for c in text]
        assert (resp.choices[0].logprobs is not None) == (turn == 0)  # captured always, returned when asked
        assert span.attributes["backend"] == "upstream" and span.attributes["model"] == "stub-model"
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"and {turn}?"}]
    assert [s.attributes["token_in"] for s in gw.spans(aid)] == [False, True, True]
    streamed = list(client.chat.completions.create(model="policy", messages=messages[:2], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == reply(
        render(messages[:2]), 50
    )
    assert gw.spans(aid)[-1].response_token_ids == gw.spans(aid)[0].response_token_ids
    comp = client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=5)
    assert gw.spans(aid)[-1].prompt_token_ids == [5, 6, 7] and comp.choices[0].text == reply("[5, 6, 7]", 5)
    stats = httpx.get(gw.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()[
        "token_in"
    ]
    assert stats["calls"] == 5 and stats["token_in"] == 2


def test_upstream_failure_is_a_502_and_an_error_span(store):
    app = create_app(store, UpstreamBackend("http://127.0.0.1:9"), keys=GatewayKeys(SECRET, ADMIN))
    with GatewayServer(app) as server:
        gw = Gateway(server, store, server.url)
        _, aid, key = gw.attempt()
        with pytest.raises(openai.InternalServerError, match="upstream request failed"):
            gw.client(key).chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}]
            )
        (span,) = gw.spans(aid)
        assert span.status == "error" and span.prompt_token_ids is None


def test_concurrent_requests_from_16_threads_are_all_recorded(gateway):
    attempts = [gateway.attempt() for _ in range(16)]
    errors: list[BaseException] = []

    def run(rid, aid, key, i):
        try:
            client = gateway.client(key)
            messages = [{"role": "user", "content": f"What is {i} plus {i}?"}]
            for _ in range(2):
                r = client.chat.completions.create(model="policy", messages=messages, max_tokens=6, seed=i)
                messages += [
                    r.choices[0].message.model_dump(exclude_none=True),
                    {"role": "user", "content": "ok"},
                ]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(*a, i)) for i, a in enumerate(attempts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for _, aid, _ in attempts:
        spans = gateway.spans(aid)
        assert [s.sequence for s in spans] == [0, 1]
        assert spans[1].attributes["token_in"] is True
        context = spans[0].prompt_token_ids + spans[0].response_token_ids
        assert spans[1].prompt_token_ids[: len(context)] == context
    assert gateway.store.count_spans(kind="llm") == 32


def test_write_behind_spans_are_committed_before_the_reward_is_acknowledged(store, stub):
    app = create_app(
        store,
        UpstreamBackend(stub.url),
        keys=GatewayKeys(SECRET, ADMIN),
        options=GatewayOptions(write_behind_ms=200),
    )
    with GatewayServer(app) as server:
        gw = Gateway(server, store, server.url)
        rid, aid, key = gw.attempt()
        client = gw.client(key)
        for i in range(3):
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": f"q{i}"}])
        reward = httpx.post(
            gw.url + "/v1/rewards", json={"value": 1.0}, headers={"Authorization": f"Bearer {key}"}
        )
        assert reward.status_code == 200
        spans = gw.spans(aid, kind=None)
        assert [s.kind.value for s in spans] == ["llm", "llm", "llm", "reward"]
        assert [s.sequence for s in spans] == [0, 1, 2, 3]


def test_cli_serves_upstream_mode_on_loopback(tmp_path, stub):
    from tests.support.secrets import serve_upstream_cli, wait_healthy

    proc, port = serve_upstream_cli(tmp_path, stub.url, SECRET, ADMIN)
    try:
        r = wait_healthy(proc, f"http://127.0.0.1:{port}", ADMIN)
        assert r.json()["backend"] == "upstream"
        assert proc.pid and psutil_listens_on_loopback(proc.pid, port)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    assert ADMIN not in out and SECRET not in out  # given in files: nothing generated, nothing printed


def psutil_listens_on_loopback(pid: int, port: int) -> bool:
    import psutil

    conns = [c for c in psutil.Process(pid).net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
    return [c.laddr for c in conns] == [("127.0.0.1", port)]


def test_http1_client_keeps_one_connection_alive(stub):
    import asyncio

    from lightning_dagster.gateway.http1 import Http1Client

    async def run():
        client = Http1Client(stub.url + "/v1", {}, timeout=10)
        body = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}'
        seen = []
        for _ in range(3):
            status, raw = await client.post("chat/completions", body)
            assert status == 200 and b"token_ids" in raw
            seen.append(id(client._idle[0][1]))
        await client.aclose()
        return seen

    seen = asyncio.run(run())
    assert len(set(seen)) == 1  # the same pooled connection served all three calls
