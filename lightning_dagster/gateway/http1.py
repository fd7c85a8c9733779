"""A lean keep-alive HTTP/1.1 client for plain-http upstreams: one `write` per request, responses parsed with
httptools. httpx costs several times the CPU per call here (`benchmarks/README.md`, gateway).
"""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import httptools


class UpstreamHTTPError(ConnectionError):
    """The upstream connection failed or returned something that is not HTTP."""


class _Response:
    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.done = False
        self.close = False

    def on_header(self, name: bytes, value: bytes) -> None:
        # httptools' should_keep_alive() is already reset once the message is complete: read the header.
        if name.lower() == b"connection" and value.strip().lower() == b"close":
            self.close = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class Http1Client:
    def __init__(self, base_url: str, headers: dict[str, str], *, timeout: float, max_idle: int = 64):
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError("Http1Client speaks plain http only")
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.prefix = parts.path.rstrip("/")
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._head = f"Host: {parts.netloc}\r\nContent-Type: application/json\r\n{extra}".encode()
        self.timeout = timeout
        self.max_idle = max_idle
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        request = (
            f"POST {self.prefix}/{path} HTTP/1.1\r\n".encode()
            + self._head
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        # A pooled connection may have been closed by the upstream meanwhile: retry once on a fresh one.
        for fresh in (False, True):
            conn = None if fresh or not self._idle else self._idle.pop()
            try:
                return await asyncio.wait_for(self._exchange(conn, request), self.timeout)
            except (OSError, asyncio.IncompleteReadError, httptools.HttpParserError) as exc:
                if fresh or conn is None:
                    raise UpstreamHTTPError(f"{type(exc).__name__}: {exc}") from exc
        raise AssertionError("unreachable")

    async def _exchange(self, conn, request: bytes) -> tuple[int, bytes]:
        reader, writer = conn or await asyncio.open_connection(self.host, self.port)
        ok = False
        try:
            writer.write(request)
            response = _Response()
            parser = httptools.HttpResponseParser(response)
            while not response.done:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionResetError("upstream closed the connection")
                parser.feed_data(data)
            ok = not response.close and parser.get_http_version() == "1.1"
            return parser.get_status_code(), b"".join(response.body)
        finally:
            if ok and len(self._idle) < self.max_idle:
                self._idle.append((reader, writer))
            else:
                writer.close()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()
