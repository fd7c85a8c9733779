"""The gateway's HTTP server on real sockets: connections that keep it waiting for a request are closed and a
slow call is not (`server.guarded_protocol`); a path or method Agent Lightning's surface lacks is a 404 or
405, a client gone mid-body is no server error, and an endpoint's unhandled error is a 500 the server
outlives."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from lightning_dagster.gateway import GatewayKeys, GatewayOptions, GatewayServer, UpstreamBackend, create_app
from lightning_dagster.store import Store
from tests.support.stub_upstream import create_stub_app

KEY, SECRET, ADMIN = "agl-server-key-0123456789", "test-secret-0123456789", "admin-key-abcdefghijkl"
AUTH = {"Authorization": f"Bearer {KEY}"}


def small_app() -> FastAPI:
    app = FastAPI()

    async def echo(request: Request) -> Response:
        return Response(b"[" + await request.body() + b"]", 201)

    async def slow(request: Request) -> Response:
        await asyncio.sleep(1.0)  # longer than the tests' client timeout
        return Response(b"done")

    async def fail(request: Request) -> Response:
        raise RuntimeError("an endpoint's own bug")

    app.add_route("/echo", echo, methods=["POST"])
    app.add_route("/slow", slow, methods=["GET"])
    app.add_route("/fail", fail, methods=["GET"])
    return app


def exchange(url: str, raw: bytes, timeout: float = 10) -> bytes:
    """Send `raw` on a new connection; everything the server answers until it closes the connection."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(raw)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


def test_a_connection_that_keeps_the_server_waiting_is_closed_and_a_slow_call_is_not():
    """uvicorn times out only the wait between requests: a connection that sent nothing, stopped inside a
    request's headers or body, or trickled it a byte at a time, was held for good. Each is closed once its
    request has not arrived within the client timeout; a request that has arrived is never cut, however long
    it is served, nor is a complete request pipelined behind it."""
    with GatewayServer(small_app(), client_timeout_s=0.3) as server:
        host, port = server.url.removeprefix("http://").split(":")
        stalls = [
            b"",
            b"POST /echo HTTP/1.1\r\nHos",
            b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\nab",
        ]
        socks = [socket.create_connection((host, int(port)), timeout=5) for _ in stalls]
        for sock, sent in zip(socks, stalls, strict=True):
            sock.sendall(sent)
        trickle = socket.create_connection((host, int(port)), timeout=5)
        started = time.monotonic()
        closed = False
        for byte in b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000:
            try:
                trickle.sendall(bytes([byte]))
            except OSError:  # reset by the server
                closed = True
                break
            time.sleep(0.02)  # every byte well inside the timeout: only a deadline per request stops it
        with trickle:
            assert closed or trickle.recv(65536) == b""
        for sock in socks:
            with sock:
                assert sock.recv(65536) == b""  # closed by the server, nothing answered
        assert time.monotonic() - started < 3
        pipelined = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
        pipelined += b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\n1"
        out = exchange(server.url, pipelined)
        assert out.startswith(b"HTTP/1.1 200") and b"done" in out and out.endswith(b"[1]")
        assert httpx.post(server.url + "/echo", content=b"1").status_code == 201


def test_an_endpoints_unhandled_error_is_a_500_and_the_server_goes_on():
    with GatewayServer(small_app()) as server:
        answer = httpx.get(server.url + "/fail")
        assert answer.status_code == 500 and answer.text == "Internal Server Error"
        assert httpx.post(server.url + "/echo", content=b"1").status_code == 201


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The gateway with Agent Lightning's surface over a SQLite store, forwarding to the stub upstream."""
    with GatewayServer(create_stub_app(reply_tokens=8)) as stub:
        store = Store(f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}")
        app = create_app(
            store,
            UpstreamBackend(stub.url, model="stub-model"),
            keys=GatewayKeys(SECRET, ADMIN, agl_key=KEY),
            options=GatewayOptions(max_body_bytes=4096),
        )
        with GatewayServer(app) as server:
            yield server
        store.close()


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
def test_a_path_or_method_the_surface_lacks_is_a_404_or_405(gateway, method, path, status, allow):
    r = httpx.request(method, gateway.url + path, headers=AUTH)
    assert r.status_code == status, r.text
    assert r.json() == {"detail": "Not Found" if status == 404 else "Method Not Allowed"}
    if allow:  # Starlette names the methods of the first route with this path, as in any FastAPI app
        assert set(r.headers["allow"].split(", ")) <= set(allow.split(", "))


@pytest.mark.parametrize(
    "method,path,kwargs,status",
    [
        ("GET", "/healthz", {}, 200),
        ("GET", "/api/rollouts", {}, 401),
        ("GET", "/api/rollouts", {"headers": {"Authorization": "Bearer wrong"}}, 401),
        ("POST", "/api/rollouts", {"headers": AUTH, "content": b"{not json"}, 400),
        ("POST", "/api/rollouts", {"headers": AUTH, "content": b"[" + b" " * 5000 + b"]"}, 413),
        ("GET", "/api/rollouts/missing", {"headers": AUTH}, 404),
        ("POST", "/v1/chat/completions", {"content": b"{}"}, 401),
    ],
)
def test_the_surfaces_errors_are_answered_by_the_apps_handlers(gateway, method, path, kwargs, status):
    r = httpx.request(method, gateway.url + path, **kwargs)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.headers["content-type"] == "application/json" and r.json()


@pytest.mark.parametrize("path", ["/api/rollouts", "/v1/chat/completions"])
def test_a_client_gone_mid_body_is_no_server_error_and_the_server_goes_on(gateway, path):
    """A client closing the connection before its body arrived made the endpoint's body read raise
    `ClientDisconnect`, which was logged as "Exception in ASGI application" with its traceback."""
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "lightning_dagster")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        for framing in ("Content-Length: 100", "Transfer-Encoding: chunked"):
            host, port = gateway.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                head = f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n{framing}\r\n\r\n"
                sock.sendall(head.encode() + (b'5\r\n[{"in' if "chunked" in framing else b'[{"in'))
                time.sleep(0.1)  # the endpoint is waiting for the rest of the body
        assert httpx.get(gateway.url + "/healthz").status_code == 200
        time.sleep(0.2)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert [r.getMessage() for r in errors] == []
