"""Upstream mode: forward to one or more OpenAI-compatible servers (vLLM-shaped responses) with sticky
routing per rollout, failover when a server is down, and, given the served model's chat codec, token-in
enforced upstream (exact prompt ids sent to the completions API instead of re-rendered chat text)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pydantic_core
from cachetools import LRUCache

from lightning_dagster.gateway.backends import Backend, CallSampling, Completion
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.http1 import Http1Client, UpstreamHTTPError
from lightning_dagster.gateway.tokenin import closing_tokens


def upstream_urls(value: str | Sequence[str]) -> list[str]:
    """One URL, a comma-separated list, or a list of either -> the distinct http(s) base URLs, in order."""
    parts = [value] if isinstance(value, str) else list(value)
    urls = [check_upstream_url(u.strip()).rstrip("/") for part in parts for u in part.split(",") if u.strip()]
    urls = [u if u.endswith("/v1") else u + "/v1" for u in urls]
    if not urls:
        raise ValueError("no upstream URL given")
    return list(dict.fromkeys(urls))


def check_upstream_url(url: str) -> str:
    """`url` if it is one http:// or https:// URL with a host and nothing after the path; else ValueError."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - a malformed port raises here
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    if parts.query or parts.fragment or any(c.isspace() or c == "," for c in url):
        raise ValueError(f"{url!r}: an upstream is a base URL (no query, fragment, spaces or commas)")
    return url


class HttpxClient:
    """TLS (or any non-plain-http) upstreams: one shared httpx client with a keep-alive pool."""

    def __init__(self, base_url: str, headers: dict[str, str], *, timeout: float):
        self._base = base_url
        self._client = httpx.AsyncClient(
            headers={**headers, "content-type": "application/json"},
            timeout=timeout,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        try:
            response = await self._client.post(f"{self._base}/{path}", content=body)
        except httpx.HTTPError as exc:
            raise UpstreamHTTPError(f"{type(exc).__name__}: {exc}") from exc
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._client.aclose()


@dataclass(eq=False)
class Upstream:
    """One server: its base URL (ending in /v1), its keep-alive client and until when it is held down."""

    url: str
    down_until: float = 0.0
    client: Http1Client | HttpxClient | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def score(self, route: str) -> bytes:
        """Rendezvous weight: every gateway ranks the servers the same way for a route, with no shared
        state, and adding or removing one server moves only the routes it wins or held."""
        return blake2b(f"{route}\0{self.url}".encode(), digest_size=8).digest()


# the code of an upstream's own 4xx answer: the call is recorded (an error span with its status) and the
# answer goes back to the agent
UPSTREAM_REFUSED = "upstream_refused"


class UpstreamPool:
    """The servers calls may go to. A route (the rollout id) goes to the healthy server that ranks highest
    for it, then stays pinned there while healthy (its prefix cache lives there)."""

    def __init__(self, urls: str | Sequence[str], *, cooldown_s: float = 10.0):
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._servers: tuple[Upstream, ...] = tuple(Upstream(u) for u in upstream_urls(urls))
        self._pins: LRUCache[str, Upstream] = LRUCache(maxsize=65536)
        self._removed: list[Upstream] = []  # their idle connections are closed with the pool

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    def add(self, url: str) -> None:
        """Serve from `url` too (no-op when it is already in the pool)."""
        (new,) = upstream_urls(url)
        with self._lock:
            if new not in self.urls:
                self._servers = (*self._servers, Upstream(new))

    def remove(self, url: str) -> None:
        """Stop sending new calls to `url` (calls in flight finish); KeyError when it is not in the pool."""
        (old,) = upstream_urls(url)
        with self._lock:
            gone = [s for s in self._servers if s.url == old]
            if not gone:
                raise KeyError(f"{old} is not an upstream of this gateway")
            if len(self._servers) == 1:
                raise ValueError("cannot remove the last upstream")
            self._servers = tuple(s for s in self._servers if s.url != old)
            self._removed += gone

    def candidates(self, route: str | None) -> list[Upstream]:
        """The servers to try for one call, in order: the route's pin if healthy, the other healthy ones by
        rank, then the ones held down (soonest back first), so a call is refused only if every one fails."""
        now = time.monotonic()
        servers = self._servers
        key = route or ""
        healthy = sorted(
            (s for s in servers if s.down_until <= now), key=lambda s: s.score(key), reverse=True
        )
        pinned = self._pins.get(route) if route is not None else None
        if pinned in healthy:
            healthy.remove(pinned)
            healthy.insert(0, pinned)
        down = sorted((s for s in servers if s.down_until > now), key=lambda s: s.down_until)
        return healthy + down

    def served(self, route: str | None, server: Upstream) -> None:
        server.down_until = 0.0
        if route is not None:
            with self._lock:
                self._pins[route] = server

    def failed(self, server: Upstream) -> None:
        server.down_until = time.monotonic() + self.cooldown_s

    async def aclose(self) -> None:
        for server in (*self._servers, *self._removed):
            if server.client is not None:
                await server.client.aclose()
                server.client = None


class UpstreamBackend(Backend):
    """Forwards to OpenAI-compatible servers (`UpstreamPool`) and reads the exact ids from their vLLM-shaped
    responses. Without `codec`, chat calls go to the chat API (the server renders). With the served model's
    `codec`, every chat call goes to the completions API as a token-id prompt (token-in, else rendered by
    the codec) and the reply's tool calls are parsed by the codec, as the engine does."""

    kind = "upstream"

    def __init__(
        self,
        urls: str | Sequence[str],
        api_key: str = "",
        model: str | None = None,
        *,
        codec: Any = None,  # `engine.chat.ChatCodec`: renders prompts and parses tool calls
        timeout: float = 600.0,
        cooldown_s: float = 10.0,
    ):
        self.pool = UpstreamPool(urls, cooldown_s=cooldown_s)
        self._api_key = api_key
        self._model = model
        self._timeout = timeout
        self.codec = codec
        self.token_in = codec is not None
        self._closing = closing_tokens(self._render) if codec is not None else None

    @property
    def model(self) -> str:
        return self._model or "upstream"

    def serves(self, name: str) -> bool:
        # Without a configured model the request's name is forwarded, and the upstream judges it.
        return self._model is None or name == self._model

    def _http(self, server: Upstream) -> Http1Client | HttpxClient:
        # One keep-alive client per server and event loop (a GatewayServer runs one loop; tests, several).
        loop = asyncio.get_running_loop()
        if server.client is None or server.loop is not loop:
            headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
            cls = Http1Client if server.url.startswith("http://") else HttpxClient
            server.client, server.loop = cls(server.url, headers, timeout=self._timeout), loop
        return server.client

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def _post(self, path: str, payload: dict, route: str | None) -> tuple[dict, str]:
        """The first answer (a 4xx included) and its server's URL; a failure or 5xx holds a server down."""
        body = pydantic_core.to_json(payload)
        failures = []
        for server in self.pool.candidates(route):
            try:
                status, raw = await self._http(server).post(path, body)
            except (UpstreamHTTPError, TimeoutError) as exc:
                failures.append(f"{server.url}: {type(exc).__name__}: {exc}")
                self.pool.failed(server)
                continue
            if status >= 500:
                failures.append(f"{server.url}: HTTP {status}")
                self.pool.failed(server)
                continue
            self.pool.served(route, server)
            return _answer(status, raw), server.url
        raise GatewayError(502, "upstream request failed on every upstream: " + "; ".join(failures))

    def _payload(self, body: dict, sampling: CallSampling) -> dict:
        drop = ("stream", "stream_options", "max_completion_tokens")  # max_tokens carries the applied limit
        payload = {k: v for k, v in body.items() if k not in drop}
        return self._sampled(payload, sampling)

    def _sampled(self, payload: dict, sampling: CallSampling) -> dict:
        if self._model:
            payload["model"] = self._model
        payload["return_token_ids"] = True
        payload["temperature"], payload["top_p"] = sampling.temperature, sampling.top_p
        if sampling.max_tokens is not None:
            payload["max_tokens"] = sampling.max_tokens
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        return payload

    def _completion(self, data: dict, *, chat: bool, served_by: str) -> Completion:
        choice = data["choices"][0]
        prompt_ids = data.get("prompt_token_ids") or choice.get("prompt_token_ids") or []
        logprobs, texts = None, None
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            logprobs = [float(t["logprob"]) for t in lp["content"]]
            texts = [t.get("token", "") for t in lp["content"]]
        elif isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):
            logprobs = [float(x) for x in lp["token_logprobs"]]
            texts = lp.get("tokens")
        if chat:
            message = choice.get("message") or {}
            content, calls = message.get("content"), message.get("tool_calls") or []
        else:
            content, calls = choice.get("text", ""), []
        return Completion(
            prompt_ids=list(prompt_ids),
            response_ids=list(choice.get("token_ids") or []),
            logprobs=logprobs,
            content=content,
            finish_reason=choice.get("finish_reason") or "stop",
            model=data.get("model") or self.model,
            tool_calls=calls,
            token_texts=texts,
            token_source="upstream",
            upstream=served_by,
        )

    async def chat(self, messages, tools, tool_choice, sampling, previous, body, *, route=None) -> Completion:
        if self.codec is None:  # the server renders
            payload = self._payload(body, sampling)
            payload["logprobs"] = True  # always captured; stripped from the reply unless the client asked
            data, served_by = await self._post("chat/completions", payload, route)
            return self._completion(data, chat=True, served_by=served_by)
        prompt_ids, source = await anyio.to_thread.run_sync(self._chat_prompt, messages, tools, previous)
        payload = self._sampled({"prompt": prompt_ids, "logprobs": 1}, sampling)
        if sampling.stop:
            payload["stop"] = list(sampling.stop)
        data, served_by = await self._post("completions", payload, route)
        c = self._completion(data, chat=False, served_by=served_by)
        if c.prompt_ids and c.prompt_ids != prompt_ids:
            raise GatewayError(502, f"upstream {served_by} answered for other prompt ids than it was sent")
        text = c.content or ""
        content, calls = (text, []) if tool_choice == "none" else self.codec.parse_assistant(text)
        c.prompt_ids, c.content, c.tool_calls, c.token_source = prompt_ids, content, calls, source
        if calls:
            c.finish_reason = "tool_calls"
        return c

    async def complete(self, prompt, sampling, body, *, route=None) -> Completion:
        payload = self._payload(body, sampling)
        payload["logprobs"] = max(1, int(body.get("logprobs") or 0))
        data, served_by = await self._post("completions", payload, route)
        return self._completion(data, chat=False, served_by=served_by)


def _answer(status: int, raw: bytes) -> dict:
    """A non-5xx upstream response -> its JSON; a 4xx is raised with the upstream's status and message."""
    try:
        data = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise GatewayError(502, f"upstream returned non-JSON (HTTP {status})") from exc
    if status >= 400:
        message = data.get("error", data) if isinstance(data, dict) else data
        if isinstance(message, dict):
            message = message.get("message", message)
        raise GatewayError(status, f"upstream error: {message}", code=UPSTREAM_REFUSED)
    if not isinstance(data, dict) or not data.get("choices"):
        raise GatewayError(502, "upstream response has no choices")
    return data
