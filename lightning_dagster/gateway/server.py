"""Run an ASGI app under uvicorn in a background thread (tests, the CLI, the demo and benchmarks); an app with
fast routes (the gateway's `app.state.fast_routes`) has them served by `gateway.fastpath`'s protocol."""

from __future__ import annotations

import os
import threading
import time

import uvicorn

from lightning_dagster.gateway.fastpath import fast_protocol, guarded_protocol


class GatewayServer:
    """`with GatewayServer(app) as server: server.url` -> `http://127.0.0.1:PORT` (port 0 picks a free one).
    `fast=False` serves every route through the app, fast routes too (tests and benchmarks compare the two);
    unset, `LD_GATEWAY_FAST_PATH=0` in the environment does the same (for a gateway started by another
    process: `gateway serve`, a rollout service's gateway process). `idle_timeout_s`: how long a connection
    may keep the server waiting for the client (between requests, before or inside a request's headers or
    body) before it is closed (`fastpath.guarded_protocol`)."""

    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        log_level: str = "warning",
        fast: bool | None = None,
        idle_timeout_s: float = 120,
    ):
        self.app = app
        self.host = host
        self.port = port
        routes = getattr(getattr(app, "state", None), "fast_routes", None)
        if fast is None:
            fast = os.environ.get("LD_GATEWAY_FAST_PATH", "1") != "0"
        protocol = fast_protocol(routes) if routes and fast else guarded_protocol()
        self._config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_keep_alive=idle_timeout_s,
            http=protocol or "auto",
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
