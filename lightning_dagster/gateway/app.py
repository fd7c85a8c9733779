"""The gateway's FastAPI app: OpenAI-compatible routes attributed to one attempt each, rewards and Agent
Lightning events, serve mode and the admin router, over one span writer. Request flow: size limit (413,
before parsing) -> key (401) -> JSON and types (400/422) -> attempt (403 for another attempt's key, 404
unknown, 409 not running) -> backend -> span committed -> response.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from lightning_dagster import paths
from lightning_dagster.gateway import rewards
from lightning_dagster.gateway.admin import admin_router
from lightning_dagster.gateway.agl import AglSettings
from lightning_dagster.gateway.agl import mount as mount_agl
from lightning_dagster.gateway.attempts import AttemptContext, Attempts, TokenInStats
from lightning_dagster.gateway.backends import Backend
from lightning_dagster.gateway.calls import llm_call
from lightning_dagster.gateway.errors import GatewayError, client_gone, error_response, store_error
from lightning_dagster.gateway.keys import GatewayKeys
from lightning_dagster.gateway.options import GatewayOptions
from lightning_dagster.gateway.recorder import SpanWriter
from lightning_dagster.gateway.weightsync import ServedWeights, WeightGate, WeightSync
from lightning_dagster.store.errors import Conflict, InvalidInput, NotFound, StoreUnavailable
from lightning_dagster.types import IllegalTransition, Sampling, Span

log = logging.getLogger("lightning_dagster.gateway")

PREFIX = "/rollouts/{rollout_id}/attempts/{attempt_id}"


class Gateway:
    """What every route shares: the store, the backend, attribution, the span writer, token-in stats and the
    weight gate (with the fleet's weight sync, when this process takes part in it)."""

    def __init__(self, store, backend: Backend, attempts: Attempts, options: GatewayOptions):
        self.store = store
        self.model_names = tuple(options.model_names)
        self.model_roots = tuple(Path(r).resolve() for r in options.model_roots or [paths.models_dir()])
        self.backend = backend
        self.attempts = attempts
        self.max_body_bytes = options.max_body_bytes
        self.durable = options.write_behind_ms <= 0
        self.fsync_spans = options.fsync_spans
        self.writer = SpanWriter(store, linger_s=max(options.write_behind_ms, 0) / 1000)
        self.stats = TokenInStats()
        started = ServedWeights(None, backend.resource_id, None)
        self.weights = WeightGate(started, wait_s=options.weights_wait_s)
        self.sync: WeightSync | None = None

    async def body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise GatewayError(413, f"the body is {declared} bytes; the limit is {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise GatewayError(413, f"the body exceeds the limit of {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def check_model(self, name: str | None) -> None:
        """Any name is served the policy unless `model_names` restricts them: then a name neither listed nor
        the backend's own is a 404, as OpenAI answers, naming the setting."""
        if name is None or not self.model_names or name in self.model_names or self.backend.serves(name):
            return
        allowed = ", ".join(dict.fromkeys([self.backend.model, *self.model_names]))
        raise GatewayError(
            404,
            f"The model `{name}` does not exist or you do not have access to it: the gateway's model_names "
            f"setting (a project's harness.model_names) allows only {allowed}; leave it unset to serve any.",
            param="model",
            code="model_not_found",
        )

    def weights_file(self, path: str) -> Path:
        """The weights file a push names, if it lies under a model root (symbolic links resolved first)."""
        resolved = Path(path).resolve()
        if not any(resolved.is_relative_to(root) for root in self.model_roots):
            roots = ", ".join(str(r) for r in self.model_roots)
            raise GatewayError(403, f"path: {path!r} is outside the model roots ({roots})", param="path")
        return resolved

    async def record(self, ctx: AttemptContext, span: Span, *, wait: bool = True, sync: bool = True) -> None:
        span.sequence = ctx.take_sequence()
        if wait and self.writer.idle and self._write_now(span, sync):
            return
        await self.writer.write([span], wait=wait, sync=sync)

    def _write_now(self, span: Span, sync: bool) -> bool:
        """Commit on the event loop when that cannot block it (unsynced, SQLite file, lock free, known
        attempt), saving two thread hand-offs per call; anything else is left to the writer thread."""
        if sync:
            return False
        try:
            return self.store.try_add_spans([span], sync=False)
        except Exception:
            return False


def create_app(
    store, backend: Backend, *, keys: GatewayKeys, options: GatewayOptions | None = None
) -> FastAPI:
    """The gateway app: `keys` sign and check its keys (with an `agl_key` it also serves Agent Lightning's
    server surface, `gateway.agl`), `options` say how it serves. Even with `write_behind_ms` > 0, rewards,
    events and admin reads wait for every span queued before them."""
    options = options or GatewayOptions()
    attempts = Attempts(store, backend, keys, options)
    gw = Gateway(store, backend, attempts, options)
    if options.weight_sync or (options.weight_sync is None and attempts.shared and backend.loads_weights):
        gw.sync = WeightSync(gw, poll_s=options.weight_sync_poll_s)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gw.weights.bind()
        if backend.loads_weights:  # what spans name until the first swap: the checkpoint served
            from lightning_dagster.engine.build import checkpoint_hash

            digest = await anyio.to_thread.run_sync(checkpoint_hash, backend.model_dir)
            gw.weights.current = ServedWeights(None, backend.resource_id, digest)
        sync = asyncio.create_task(gw.sync.run()) if gw.sync is not None else None
        try:
            yield
        finally:
            if sync is not None:
                sync.cancel()
                try:
                    await gw.sync.stop()
                except Exception:  # noqa: BLE001 - the report ages out of the live set anyway
                    log.exception("could not report this gateway stopped")
            await backend.aclose()
            await anyio.to_thread.run_sync(gw.writer.close)

    app = FastAPI(title="lightning-dagster gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(request, exc)

    app.add_exception_handler(ClientDisconnect, client_gone)  # a client gone mid-body: no server error

    for named in (IllegalTransition, Conflict, InvalidInput, NotFound, StoreUnavailable):

        @app.exception_handler(named)
        async def _store_error(request: Request, exc: Exception) -> Response:
            return await _gateway_error(request, store_error(exc))

    async def chat_completions(request: Request) -> Response:
        return await llm_call(gw, request, dict(request.path_params), chat=True)

    async def completions(request: Request) -> Response:
        return await llm_call(gw, request, dict(request.path_params), chat=False)

    async def post_reward(request: Request) -> dict:
        return await rewards.reward(gw, request, dict(request.path_params))

    async def post_event(request: Request) -> dict:
        return await rewards.event(gw, request, dict(request.path_params))

    async def models(request: Request) -> dict:
        attempts.caller(request)
        names = dict.fromkeys([backend.model, *gw.model_names])
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "lightning-dagster"} for n in names]
        return {"object": "list", "data": data}

    for prefix in ("", PREFIX):
        # The LLM routes read the raw body themselves: plain Starlette routes, no FastAPI dependency solving.
        for path, endpoint in (("/v1/chat/completions", chat_completions), ("/v1/completions", completions)):
            app.add_route(prefix + path, endpoint, methods=["POST"])
        app.add_api_route(prefix + "/v1/models", models, methods=["GET"])
        app.add_api_route(prefix + "/v1/rewards", post_reward, methods=["POST"])
        app.add_api_route(prefix + "/v1/events", post_event, methods=["POST"])
    if keys.agl_key:
        train, val = options.agl_train_temperature, options.agl_val_temperature
        agl = AglSettings(keys.agl_key, train=Sampling(temperature=train), val=Sampling(temperature=val))
        mount_agl(app, gw, agl)  # its event URL takes attempt keys too
    else:  # Agent Lightning's own event URL, so a harness configured for agl-server can post here unchanged
        app.add_api_route(
            "/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", post_event, methods=["POST"]
        )
    app.include_router(admin_router(gw))
    return app
