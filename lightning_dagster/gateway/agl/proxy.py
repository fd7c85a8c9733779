"""Agent Lightning's proxy: `/proxy/rollout/{rid}/attempt/{aid}/mode/{train|val}/openai/v1/(chat/)completions`
served by the gateway's own LLM route, model endpoints registered at run time (`/api/models`), and
pause/resume around weight updates (`/proxy/pause|resume|state`: 429 meanwhile). Both survive a restart."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import pydantic_core
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.agl import Agl, reply, validated
from lightning_dagster.gateway.attempts import RolloutDeleted
from lightning_dagster.gateway.backends import Backend
from lightning_dagster.gateway.calls import llm_call
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.upstreams import UpstreamBackend, check_upstream_url

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway

MODELS_FLAG, PAUSE_FLAG = "agl.models", "agl.proxy"
log = logging.getLogger(__name__)

PATHS = {"chat/completions": True, "completions": False}  # -> chat
ROUTE: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("agl_route", default=None)


class ModelEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)
    endpoint: str = Field(min_length=1, max_length=2048)
    version: int = 0

    @field_validator("endpoint")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return check_upstream_url(value)  # its ValueError is a 422 naming the field


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    retry_after_seconds: int = Field(5, ge=0, le=86_400)  # sent back as Retry-After: at most a day
    reason: str | None = Field(None, max_length=1024)


MODELS, PAUSE = TypeAdapter(list[ModelEntry]), TypeAdapter(PauseRequest)


class RoutedBackend:
    """The gateway's backend, but what serves a call (`ROUTED`) is the endpoint it was routed to (`ROUTE`)."""

    ROUTED = frozenset({"model", "kind", "token_in", "resource_id", "serves", "chat", "complete"})

    def __init__(self, default: Backend):
        self.default = default

    def __getattr__(self, name: str) -> Any:
        return getattr((ROUTE.get() if name in self.ROUTED else None) or self.default, name)


@dataclass
class Pause:
    paused: bool = False
    retry_after_seconds: int = 5
    reason: str | None = None
    inflight: int = 0


class Endpoints:
    """Registered model endpoints keyed by (model, endpoint), served as one `UpstreamBackend` (a rollout
    sticks to one server); the model name sent upstream is the first registered one's."""

    def __init__(self, entries: list[dict]):
        self.entries: dict[tuple[str, str], ModelEntry] = {}
        self.backend: UpstreamBackend | None = None
        valid = []
        # registered by an earlier server, maybe one that checked less: skip what is invalid
        for e in entries:
            try:
                valid.append(ModelEntry.model_validate(e))
            except ValidationError as exc:
                log.warning("skipping a stored model endpoint that is not valid (%r): %s", e, exc)
        self.add(valid)

    def add(self, entries: list[ModelEntry]) -> None:
        for e in entries:
            self.entries[(e.model, e.endpoint)] = e
            if self.backend is None:
                self.backend = UpstreamBackend(e.endpoint, model=e.model)
            else:
                self.backend.pool.add(e.endpoint)

    async def clear(self) -> None:
        backend, self.backend, self.entries = self.backend, None, {}
        if backend is not None:
            await backend.aclose()


def _paused(pause: Pause) -> Response:
    body = {"error": "gateway paused", "reason": pause.reason}
    headers = {"Retry-After": str(pause.retry_after_seconds), "X-Agl-Paused": "true"}
    return Response(pydantic_core.to_json(body), 429, headers=headers, media_type="application/json")


def _inner_request(request: Request, body: bytes, key: str, rollout_id: str, attempt_id: str) -> Request:
    """The proxied call as the gateway's LLM route sees it: the attempt's own key and path."""
    drop = (b"authorization", b"x-api-key", b"content-length")
    headers = [(k, v) for k, v in request.scope["headers"] if k not in drop]
    headers += [(b"authorization", b"Bearer " + key.encode()), (b"content-length", str(len(body)).encode())]
    scope = {
        **request.scope,
        "headers": headers,
        "path_params": {"rollout_id": rollout_id, "attempt_id": attempt_id},
    }

    async def receive() -> dict:
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def routes(app: FastAPI, gw: Gateway, agl: Agl) -> list[tuple[str, Any, str]]:
    """(path, endpoint, method) of this module's routes."""
    store = gw.store
    routed = RoutedBackend(gw.backend)
    gw.backend = routed
    endpoints = Endpoints((store.get_flag(MODELS_FLAG) or {}).get("models", []))
    pause = Pause(**(store.get_flag(PAUSE_FLAG) or {}))
    # Held from a change of the pause or the registered endpoints until the store has it: concurrent
    # changes reach the store in the order they were made, so a restart comes back in the last one's state.
    changing = asyncio.Lock()

    async def proxied(request: Request) -> Response:
        agl.check(request)
        p = request.path_params
        rid, mode, chat = p["rollout_id"], p["mode"], PATHS.get(p["upstream_path"])
        if mode not in ("train", "val"):
            raise GatewayError(404, f"unsupported proxy mode: {mode}")
        if chat is None:
            raise GatewayError(404, f"unsupported upstream path: {p['upstream_path']}")
        if pause.paused:
            return _paused(pause)
        target = await agl.target(store, rid, p["attempt_id"])
        if mode != target.mode:
            raise GatewayError(409, f"rollout {rid} samples in {target.mode} mode, not {mode}", param="mode")
        body = schemas.parse(await gw.body(request))
        route = endpoints.backend
        backend = route or routed.default
        name = body.get("model")
        if gw.model_names and name not in gw.model_names and not backend.serves(name or ""):
            body["model"] = backend.model
        if mode == "train":
            body["logprobs"] = True if chat else max(1, int(body.get("logprobs") or 0))
        inner = _inner_request(request, pydantic_core.to_json(body), target.key, rid, target.attempt_id)
        # Paused while its attempt was looked up or its body arrived: refused too. The check and the count
        # have no await between them, so a call is either refused or counted in the `inflight` a pause
        # reports (a caller updating weights once that reads 0 never has a call reach the old ones).
        if pause.paused:
            return _paused(pause)
        pause.inflight += 1
        token = ROUTE.set(route)
        try:  # an upstream's 4xx is recorded by the LLM route like any refused call
            return await llm_call(gw, inner, dict(inner.path_params), chat=chat)
        except RolloutDeleted:  # through another replica (refused before the upstream): forget its attempts
            agl.moved(rid)
            raise
        finally:
            ROUTE.reset(token)
            pause.inflight -= 1

    async def register(request: Request) -> Response:
        agl.check(request)
        entries = validated(MODELS, await gw.body(request))
        async with changing:
            endpoints.add(entries)
            await anyio.to_thread.run_sync(
                store.set_flag, MODELS_FLAG, {"models": [e.model_dump() for e in endpoints.entries.values()]}
            )
        return reply([e.model_dump() for e in entries], 201)

    async def unregister(request: Request) -> Response:
        agl.check(request)
        async with changing:
            await endpoints.clear()
            await anyio.to_thread.run_sync(store.set_flag, MODELS_FLAG, {"models": []})
        return reply({"status": "ok"})

    async def set_pause(paused: bool, req: PauseRequest | None) -> Response:
        async with changing:
            pause.paused = paused
            if req is not None:
                pause.retry_after_seconds, pause.reason = req.retry_after_seconds, req.reason
            if not paused:
                pause.reason = None
            kept = {k: v for k, v in dataclasses.asdict(pause).items() if k != "inflight"}
            await anyio.to_thread.run_sync(store.set_flag, PAUSE_FLAG, kept)
            return reply(dataclasses.asdict(pause))

    async def pause_route(request: Request) -> Response:
        agl.check(request)
        raw = await gw.body(request)
        return await set_pause(True, validated(PAUSE, raw) if raw.strip() else PauseRequest())

    async def resume_route(request: Request) -> Response:
        agl.check(request)
        return await set_pause(False, None)

    async def state_route(request: Request) -> Response:
        agl.check(request)
        return reply(dataclasses.asdict(pause))

    inner_close = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(application: FastAPI):
        async with inner_close(application) as state:
            try:
                yield state
            finally:
                await endpoints.clear()

    app.router.lifespan_context = lifespan
    prefix = "/proxy/rollout/{rollout_id}/attempt/{attempt_id}/mode/{mode}/openai/v1/{upstream_path:path}"
    return [
        (prefix, proxied, "POST"),
        ("/api/models", register, "POST"),
        ("/api/models", unregister, "DELETE"),
        ("/proxy/pause", pause_route, "POST"),
        ("/proxy/resume", resume_route, "POST"),
        ("/proxy/state", state_route, "GET"),
    ]
