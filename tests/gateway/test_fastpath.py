"""The fast path (`gateway.fastpath`): routes served by uvicorn's protocol without the app's ASGI stack answer
exactly as the app answers them, on real sockets: the same statuses, headers and bodies (errors included),
keep-alive, pipelined requests in order, `Connection: close`, HTTP/1.0, chunked and unread request bodies,
percent-encoded paths, `Expect: 100-continue`, bodies over the limit, streamed responses, concurrent clients,
and an endpoint's unhandled error as a 500 that leaves the server serving."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import time

import httpx
import pytest
from fastapi import FastAPI, HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lightning_dagster.gateway import GatewayServer, UpstreamBackend, create_app
from lightning_dagster.gateway.agl import AglSettings
from lightning_dagster.gateway.errors import GatewayError, answered
from lightning_dagster.gateway.fastpath import FastRoutes, fast_protocol
from lightning_dagster.store import Store
from tests.support.stub_upstream import create_stub_app

KEY, SECRET, ADMIN = "agl-server-key-0123456789", "test-secret-0123456789", "admin-key-abcdefghijkl"


def test_routes_match_method_and_template_in_order():
    routes = FastRoutes()

    async def a(request):  # pragma: no cover - never called
        return Response()

    async def b(request):  # pragma: no cover - never called
        return Response()

    routes.add("/api/rollouts/{rollout_id}", a, "GET")
    routes.add("/api/rollouts/{rollout_id}", b, "PATCH")
    routes.add("/api/{anything}/{rest}", b, "GET")
    assert routes.match("GET", "/api/rollouts/r-1") == (a, {"rollout_id": "r-1"})
    assert routes.match("PATCH", "/api/rollouts/r-1") == (b, {"rollout_id": "r-1"})
    assert routes.match("DELETE", "/api/rollouts/r-1") is None  # the app answers it (405 or its own route)
    assert routes.match("GET", "/api/rollouts/r-1/extra") is None
    assert routes.match("GET", "/api/x/y") == (b, {"anything": "x", "rest": "y"})
    assert fast_protocol(routes) is not None


def small_app() -> FastAPI:
    """One app whose routes are both app routes and fast routes: plain, refused, failing and streamed."""
    app = FastAPI()
    fast = app.state.fast_routes = FastRoutes()

    async def echo(request: Request) -> Response:
        body = await request.body()
        tag = request.headers.get("x-tag", "")
        return Response(b"[" + body + b"]", 201, headers={"x-echo": tag}, media_type="application/json")

    async def refuse(request: Request) -> Response:
        raise GatewayError(418, f"no {request.path_params['what']}", param="what")

    async def fail(request: Request) -> Response:
        raise RuntimeError("an endpoint's own bug")

    async def stream(request: Request) -> Response:
        async def parts():
            for i in range(3):
                yield f"data: {i}\n\n".encode()

        return StreamingResponse(parts(), media_type="text/event-stream")

    async def teapot(request: Request) -> Response:
        raise HTTPException(418, "short and stout", headers={"x-why": "tea"})

    async def closing(request: Request) -> Response:
        return Response(b"bye", headers={"connection": "close"})

    for path, endpoint, method in [
        ("/echo", echo, "POST"),
        ("/refuse/{what}", refuse, "GET"),
        ("/fail", fail, "GET"),
        ("/stream", stream, "GET"),
        ("/closing", closing, "GET"),
        ("/teapot", teapot, "GET"),
    ]:
        app.add_route(path, answered(endpoint), methods=[method])
        fast.add(path, answered(endpoint), method)
    return app


@pytest.fixture(scope="module")
def servers():
    with GatewayServer(small_app()) as fast, GatewayServer(small_app(), fast=False) as slow:
        yield fast, slow


def same(fast: httpx.Response, slow: httpx.Response) -> None:
    def shape(r: httpx.Response):
        return r.status_code, sorted((k, v) for k, v in r.headers.items() if k != "date"), r.content

    assert shape(fast) == shape(slow)


@pytest.mark.parametrize(
    "method,path,kwargs",
    [
        ("POST", "/echo", {"content": b'{"a":1}', "headers": {"x-tag": "t"}}),
        ("POST", "/echo", {"content": b""}),
        ("GET", "/refuse/tea", {}),
        ("GET", "/stream", {}),
        ("GET", "/closing", {}),
        ("GET", "/teapot", {}),
        ("GET", "/echo", {}),  # a method the route does not take: the app's 405
        ("HEAD", "/echo", {}),
        ("GET", "/nowhere", {}),
    ],
)
def test_the_fast_path_answers_as_the_app_does(servers, method, path, kwargs):
    fast, slow = servers
    same(httpx.request(method, fast.url + path, **kwargs), httpx.request(method, slow.url + path, **kwargs))


def exchange(url: str, raw: bytes, *, until_closed: bool = False, timeout: float = 10) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(raw)
        out = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                assert not until_closed, f"the server kept the connection open: {out!r}"
                return out
            if not chunk:
                return out
            out += chunk
            if not until_closed and out.count(b"HTTP/1.1 ") >= raw.count(b"HTTP/1.1\r\n"):
                if out.endswith(b"]") or out.endswith(b"}"):
                    return out


def test_pipelined_requests_are_answered_in_order_on_one_connection(servers):
    fast, _ = servers
    requests = b"".join(
        f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {len(str(i))}\r\nx-tag: {i}\r\n\r\n{i}".encode()
        for i in range(5)
    )
    # a request for an app route between fast ones waits its turn too
    requests += b"GET /refuse/x HTTP/1.1\r\nHost: x\r\n\r\n"
    requests += b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n9"
    out = exchange(fast.url, requests)
    answers = [part for part in out.split(b"HTTP/1.1 ") if part]
    assert [a[:3] for a in answers] == [b"201"] * 5 + [b"418", b"201"]
    assert [a.rsplit(b"\r\n\r\n", 1)[1] for a in answers[:5]] == [b"[%d]" % i for i in range(5)]
    assert answers[-1].endswith(b"[9]")


def test_connection_close_is_honoured_both_ways(servers):
    fast, _ = servers
    out = exchange(
        fast.url,
        b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n\r\nhi",
        until_closed=True,
    )
    assert out.startswith(b"HTTP/1.1 201") and b"connection: close" in out.lower() and out.endswith(b"[hi]")
    out = exchange(fast.url, b"GET /closing HTTP/1.1\r\nHost: x\r\n\r\n", until_closed=True)
    assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"bye")


def test_expect_100_continue_gets_its_interim_answer_before_the_body_is_read(servers):
    fast, _ = servers
    host, port = fast.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
        assert sock.recv(1024).startswith(b"HTTP/1.1 100 Continue")
        sock.sendall(b"abc")
        answer = b""
        while not answer.endswith(b"[abc]"):
            chunk = sock.recv(1024)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 201")


def test_an_endpoints_unhandled_error_is_a_500_and_the_server_goes_on(servers, caplog):
    fast, slow = servers
    with caplog.at_level("ERROR"):
        same(httpx.get(fast.url + "/fail"), httpx.get(slow.url + "/fail"))
    assert "an endpoint's own bug" in caplog.text
    assert httpx.post(fast.url + "/echo", content=b"1").status_code == 201


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    """The gateway with Agent Lightning's surface twice, each over its own SQLite store: fast and not."""
    stub = GatewayServer(create_stub_app(reply_tokens=8)).start()
    made = []
    for fast in (True, False):
        store = Store(f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}")
        app = create_app(
            store,
            UpstreamBackend(stub.url, model="stub-model"),
            secret=SECRET,
            admin_key=ADMIN,
            agl=AglSettings(KEY),
            max_body_bytes=4096,
        )
        made.append((GatewayServer(app, fast=fast).start(), store))
    yield [server for server, _ in made]
    for server, store in made:
        server.stop()
        store.close()
    stub.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    "method,path,kwargs",
    [
        ("GET", "/healthz", {}),
        ("GET", "/api/rollouts", {}),  # no key: 401
        ("GET", "/api/rollouts", {"headers": {"Authorization": "Bearer wrong"}}),
        ("POST", "/api/rollouts", {"headers": AUTH, "content": b"{not json"}),
        ("POST", "/api/rollouts", {"headers": AUTH, "json": [{"input": {}, "rollout_id": "r1", "bogus": 1}]}),
        ("POST", "/api/rollouts", {"headers": AUTH, "content": b"[" + b" " * 5000 + b"]"}),  # over the limit
        ("GET", "/api/rollouts/missing", {"headers": AUTH}),
        ("PATCH", "/api/rollouts/missing", {"headers": AUTH, "json": {"status": {"state": "running"}}}),
        ("DELETE", "/api/rollouts/missing", {"headers": AUTH}),
        ("POST", "/api/rollouts/missing/attempt/0/events", {"headers": AUTH, "json": {"event_type": "x"}}),
        ("GET", "/api/rollouts/missing/events", {"headers": AUTH}),
        (
            "POST",
            "/proxy/rollout/missing/attempt/0/mode/train/openai/v1/chat/completions",
            {"headers": AUTH, "json": {}},
        ),
        ("POST", "/v1/chat/completions", {"content": b"{}"}),  # no attempt key: the LLM route's 401
        ("POST", "/v1/chat/completions", {"headers": {"Authorization": "Bearer x"}, "content": b"[1"}),
        ("PUT", "/api/rollouts", {"headers": AUTH}),  # not a route of the surface: the app's answer
    ],
)
def test_the_gateways_fast_routes_answer_as_through_the_app(gateways, method, path, kwargs):
    fast, slow = gateways
    same(httpx.request(method, fast.url + path, **kwargs), httpx.request(method, slow.url + path, **kwargs))


@pytest.mark.parametrize(
    "method,path,status,allow",
    [
        ("GET", "/api/nope", 404, None),
        ("GET", "/api/rollouts/a%2Fb", 404, None),  # an encoded slash: a path no route takes
        ("GET", "/proxy/nope", 404, None),
        ("PUT", "/api/rollouts", 405, "GET, POST"),
        ("GET", "/api/models", 405, "DELETE, POST"),
        ("POST", "/healthz", 405, "GET, HEAD"),
        ("PUT", "/proxy/pause", 405, "POST"),
    ],
)
def test_a_path_or_method_the_surface_lacks_is_a_404_or_405_not_a_500(gateways, method, path, status, allow):
    """Agent Lightning's router raises its own 404 and 405 outside the app's exception middleware: they were
    500s on both paths (and closed the connection). Now answered as FastAPI answers them, 405 with Allow."""
    answers = [httpx.request(method, s.url + path, headers=AUTH) for s in gateways]
    for r in answers:
        assert r.status_code == status, r.text
        assert r.json() == {"detail": "Not Found" if status == 404 else "Method Not Allowed"}
        if allow:  # Starlette names the methods of the first route with this path, as in any FastAPI app
            assert set(r.headers["allow"].split(", ")) <= set(allow.split(", "))
    same(*answers)


@pytest.mark.parametrize("path", ["/api/rollouts", "/v1/chat/completions"])
def test_a_client_gone_mid_body_is_no_server_error_and_the_server_goes_on(gateways, path):
    """A client closing the connection before its body arrived made the endpoint's body read raise
    `ClientDisconnect`, logged as "Exception in ASGI application" with its traceback on both paths."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "lightning_dagster")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        for server in gateways:
            for framing in ("Content-Length: 100", "Transfer-Encoding: chunked"):
                host, port = server.url.removeprefix("http://").split(":")
                with socket.create_connection((host, int(port)), timeout=10) as sock:
                    head = (
                        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n{framing}\r\n\r\n"
                    )
                    sock.sendall(head.encode() + (b'5\r\n[{"in' if "chunked" in framing else b'[{"in'))
                    time.sleep(0.1)  # the endpoint is waiting for the rest of the body
            assert httpx.get(server.url + "/healthz").status_code == 200
        time.sleep(0.2)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert [r.getMessage() for r in errors] == []


def test_a_rollout_made_and_called_on_the_fast_path_reads_back_as_through_the_app(gateways):
    fast, slow = gateways
    for server in gateways:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as api:
            created = api.post("/api/rollouts", json=[{"input": {"q": "2+2"}, "rollout_id": "same"}])
            assert created.status_code == 201, created.text
            proxy = "/proxy/rollout/same/attempt/0/mode/train/openai/v1/chat/completions"
            call = api.post(proxy, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
            assert call.status_code == 200, call.text
            assert len(call.json()["choices"][0]["token_ids"]) == 8
            events = api.get("/api/rollouts/same/events", params={"format": "triplet"})
            assert events.status_code == 200 and len(events.json()) == 1
    one = [httpx.get(s.url + "/api/rollouts/same", headers=AUTH).json() for s in gateways]
    drop = ("start_time", "end_time", "last_heartbeat_time", "attempt_id", "created_at", "updated_at")

    def strip(value):
        if isinstance(value, dict):  # attempt ids are random: their number is compared
            return {k: len(v) if k == "attempts" else strip(v) for k, v in value.items() if k not in drop}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    assert strip(one[0]) == strip(one[1])


def without_date(raw: bytes) -> bytes:
    return b"\r\n".join(line for line in raw.split(b"\r\n") if not line.lower().startswith(b"date:"))


@pytest.mark.parametrize(
    "raw",
    [
        # a chunked request body, reassembled before the endpoint reads it
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        # HTTP/1.0: the connection closes after the answer
        b"POST /echo HTTP/1.0\r\nContent-Length: 2\r\n\r\nhi",
        # a percent-encoded path parameter, decoded alike
        b"GET /refuse/caf%C3%A9%20au%20lait HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        # a body sent to a route that never reads it
        b"GET /closing HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nxxxxx",
    ],
)
def test_raw_requests_get_the_same_bytes_back_on_both_paths(servers, raw):
    fast, slow = servers
    answers = [without_date(exchange(s.url, raw, until_closed=True)) for s in (fast, slow)]
    assert answers[0] == answers[1] and answers[0].startswith(b"HTTP/1.1 ")


def test_concurrent_clients_each_get_their_own_answers(servers):
    fast, _ = servers

    def client(n: int) -> list[bytes]:
        with httpx.Client(base_url=fast.url) as c:
            return [c.post("/echo", content=f"{n}-{i}".encode()).content for i in range(25)]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(client, range(16)))
    assert got == [[f"[{n}-{i}]".encode() for i in range(25)] for n in range(16)]


@pytest.mark.parametrize("fast", [True, False])
def test_a_connection_that_keeps_the_server_waiting_is_closed_and_a_slow_call_is_not(fast):
    """uvicorn timed out only the wait between requests: a connection that sent nothing, or stopped inside
    a request's headers or body, was held for good. Now closed after the idle timeout, on both paths; a
    request whose body has arrived is never cut, however long its endpoint takes."""
    app = small_app()

    async def slow(request: Request) -> Response:
        await asyncio.sleep(1.0)  # longer than the idle timeout
        return Response(b"done")

    app.add_route("/slow", slow, methods=["GET"])
    app.state.fast_routes.add("/slow", slow, "GET")
    with GatewayServer(app, fast=fast, idle_timeout_s=0.3) as server:
        host, port = server.url.removeprefix("http://").split(":")
        stalls = [
            b"",
            b"POST /echo HTTP/1.1\r\nHos",
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab",
        ]
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in stalls]
        for sock, sent in zip(socks, stalls, strict=True):
            sock.sendall(sent)
        started = time.monotonic()
        for sock in socks:
            with sock:
                assert sock.recv(65536) == b""  # closed by the server, nothing answered
        assert time.monotonic() - started < 3
        out = exchange(
            server.url, b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", until_closed=True
        )
        assert out.startswith(b"HTTP/1.1 200") and out.endswith(b"done")
        assert httpx.post(server.url + "/echo", content=b"1").status_code == 201
