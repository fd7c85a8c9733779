"""Run an ASGI app under uvicorn in a background thread (the gateway, tests, the demo and benchmarks), with
connections that keep the server waiting for a request closed (`guarded_protocol`)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def guarded_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol closing a connection whose request has not arrived whole within
    `timeout_s` of its first byte (or of the connection). uvicorn times out only the wait between requests,
    so a client that stalls inside one held its connection (and a file descriptor) for good. A request that
    has arrived is never cut. Only the asyncio protocol methods are overridden; framing has its own parser."""

    class GuardedProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            framing = SimpleNamespace(on_message_begin=self.guard_arm, on_message_complete=self.guard_disarm)
            self._guard_framing: httptools.HttpRequestParser | None = httptools.HttpRequestParser(framing)
            self._guard_deadline: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self.guard_arm()

        def data_received(self, data: bytes) -> None:
            if self._guard_framing is not None:
                try:
                    self._guard_framing.feed_data(data)
                except httptools.HttpParserError:  # malformed, or an upgrade: uvicorn answers it
                    self._guard_framing = None
                    self.guard_disarm()
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.guard_disarm()
            super().connection_lost(exc)

        def guard_arm(self) -> None:
            if self._guard_deadline is None:
                self._guard_deadline = asyncio.get_running_loop().call_later(timeout_s, self._guard_expire)

        def guard_disarm(self) -> None:
            if self._guard_deadline is not None:
                self._guard_deadline.cancel()
                self._guard_deadline = None

        def _guard_expire(self) -> None:
            self._guard_deadline = None
            if not self.transport.is_closing():
                if self.transport.is_reading():
                    self.transport.close()
                else:  # the server paused reading: not the client's delay
                    self.guard_arm()

    return GuardedProtocol


class GatewayServer:
    """`with GatewayServer(app) as server: server.url` -> `http://127.0.0.1:PORT` (port 0 picks a free one).
    `client_timeout_s`: how long the server waits for a client, for a request to arrive whole
    (`guarded_protocol`) and for the next request on an idle connection."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        client_timeout_s: float = 120,
    ):
        self.app = app
        self.host = host
        self.port = port
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_keep_alive=client_timeout_s,
            http=guarded_protocol(client_timeout_s),
        )
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> GatewayServer:
        self._server = uvicorn.Server(self._config)
        self._thread = threading.Thread(target=self._server.run, name="gateway-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=30)
            self._server = self._thread = None

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
