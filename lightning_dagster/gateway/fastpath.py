"""The gateway's hot routes served by uvicorn's HTTP protocol without the ASGI app's per-request stack.

A request for a route in the app's `FastRoutes` (the LLM routes; with `--agl-key-file`, Agent Lightning's
REST API, proxy paths and `/healthz`) is handed by `FastProtocol` straight to its endpoint, the Starlette
endpoint the app would have reached (same `Request`, same `Response`, same errors), and a plain response is
written in one piece: status line, headers and body in one `write`. Everything else (another route, a method
the route does not take, a streamed response's body) goes the usual way, through the app or uvicorn's own
`send`. What this skips per request: uvicorn's proxy-headers middleware, FastAPI's and Starlette's middleware
chain (error middleware, telemetry, body limit, exception wrappers), the router's walk over every route, and
the second socket write of a response sent as two ASGI messages. The endpoints check body sizes themselves
(`Gateway.body`).

It subclasses `uvicorn.protocols.http.httptools_impl.HttpToolsProtocol` and drives its request cycle, which
are uvicorn internals: pyproject pins uvicorn exactly, and `fast_protocol` returns None (uvicorn's own
protocol is used, every route served through the app) if the cycle does not look as this module expects.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import compile_path

log = logging.getLogger(__name__)

Endpoint = Callable[[Request], Awaitable[Response]]


class FastRoutes:
    """(method, path template, endpoint) routes matched in the order they were added."""

    def __init__(self) -> None:
        self._routes: list[tuple[str, re.Pattern[str], dict[str, Any], Endpoint]] = []

    def add(self, path: str, endpoint: Endpoint, method: str) -> None:
        regex, _, convertors = compile_path(path)
        self._routes.append((method, regex, convertors, endpoint))

    def match(self, method: str, path: str) -> tuple[Endpoint, dict[str, Any]] | None:
        for route_method, regex, convertors, endpoint in self._routes:
            if route_method == method and (found := regex.match(path)):
                params = {k: convertors[k].convert(v) for k, v in found.groupdict().items()}
                return endpoint, params
        return None

    def __len__(self) -> int:
        return len(self._routes)


def _httptools_impl():
    """uvicorn's httptools protocol module, if its request cycle is the one this module drives (else None)."""
    try:
        from uvicorn.protocols.http import httptools_impl as impl
    except ImportError:  # httptools missing: uvicorn serves with h11, all through the app
        return None
    cycle_fields = (
        "scope",
        "transport",
        "flow",
        "message_event",
        "keep_alive",
        "default_headers",
        "on_response",
    )
    init = impl.RequestResponseCycle.__init__.__code__.co_varnames
    protocol = impl.HttpToolsProtocol
    needed = ("_start_asgi_task", "timeout_keep_alive_handler", "_unset_keepalive_if_required")
    if not all(hasattr(protocol, f) for f in needed) or not all(f in init for f in cycle_fields):
        log.warning("uvicorn's HTTP protocol is not the one the fast path drives: serving through the app")
        return None
    return impl


def guarded_protocol() -> type | None:
    """uvicorn's httptools protocol closing a connection on which the server has waited for the client
    longer than `timeout_keep_alive`: one that never sends a request, stops inside a request's headers, or
    stops inside its body. uvicorn's own times out only the wait between requests, so such connections were
    held for good (a client could hold every file descriptor the server may open). A request whose body has
    arrived is never timed out (an LLM call may take minutes), nor one whose reading waits for the server
    (flow control, a pipelined request behind a running one). None where uvicorn's internals differ."""
    impl = _httptools_impl()
    if impl is None:
        return None

    class GuardedProtocol(impl.HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._wait_for_client()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)  # cancels the timer first
            self._wait_for_client()

        def _wait_for_client(self) -> None:
            cycle = self.cycle
            waiting = cycle is None or cycle.response_complete or cycle.more_body
            if (
                waiting
                and self.timeout_keep_alive_task is None
                and not self.flow.read_paused
                and not self.transport.is_closing()
            ):
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    return GuardedProtocol


def fast_protocol(routes: FastRoutes) -> type | None:
    """`guarded_protocol` serving `routes` itself (None where uvicorn's internals differ from what this
    module drives: then the caller keeps uvicorn's default protocol)."""
    base = guarded_protocol()
    if base is None:
        return None
    from uvicorn.protocols.http import httptools_impl as impl

    class FastProtocol(base):
        def _start_asgi_task(self, cycle, app) -> None:
            scope = cycle.scope
            found = routes.match(scope["method"], scope["path"]) if app is self.app else None
            if found is None:
                return super()._start_asgi_task(cycle, app)
            task = self.loop.create_task(_serve(cycle, scope, *found))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)

    async def _serve(cycle, scope: dict, endpoint: Endpoint, params: dict[str, Any]) -> None:
        scope["path_params"] = params
        try:
            response = await endpoint(Request(scope, cycle.receive))
            if response.background is None and isinstance(response.__dict__.get("body"), bytes):
                await _write_whole(cycle, response)  # a plain response: its whole body is at hand
            else:
                await response(scope, cycle.receive, cycle.send)
        except BaseException as exc:  # as the app's error middleware and uvicorn answer an unhandled error
            log.error("Exception in ASGI application\n", exc_info=exc)
            if not cycle.response_started:
                await _write_whole(cycle, PlainTextResponse("Internal Server Error", 500))
            cycle.transport.close()
        finally:
            cycle.on_response = lambda: None

    async def _write_whole(cycle, response: Response) -> None:
        """`response` as uvicorn's `send` writes it (its default headers first; `connection: close` when the
        connection does not stay open), in one write."""
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        content = [impl.STATUS_LINE[response.status_code]]
        close = False
        for name, value in (*cycle.default_headers, *response.raw_headers):
            if impl.HEADER_RE.search(name) or impl.HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header.")
            name = name.lower()
            if name == b"connection" and b"close" in [t.strip().lower() for t in value.split(b",")]:
                cycle.keep_alive, close = False, True
            content += [name, b": ", value, b"\r\n"]
        if not cycle.keep_alive and not close:
            content.append(b"connection: close\r\n")
        content += [b"\r\n", response.body]
        cycle.transport.write(b"".join(content))
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

    return FastProtocol
