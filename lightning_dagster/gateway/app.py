"""The gateway's FastAPI app: OpenAI-compatible routes, attribution by per-attempt key or path, one LLM span
per call with exact ids, token-in across turns, rewards and Agent Lightning events, serve mode, admin.

Request flow: size limit (413, before parsing) -> key (401) -> JSON and types (400/422) -> attempt (403 for
another attempt's key, 404 unknown, 409 not running) -> backend -> span committed -> response.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.backends import Backend, Completion
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.keys import attempt_key, parse_attempt_key, same_key
from lightning_dagster.gateway.recorder import SpanWriter
from lightning_dagster.gateway.tokenin import LastCall, extends
from lightning_dagster.store.errors import NotFound
from lightning_dagster.types import AttemptState, IllegalTransition, Reward, RolloutKind, Span, SpanKind

log = logging.getLogger("lightning_dagster.gateway")

PREFIX = "/rollouts/{rollout_id}/attempts/{attempt_id}"


@dataclass
class Caller:
    kind: str  # attempt | serve | admin
    rollout_id: str | None = None
    attempt_id: str | None = None


@dataclass
class TokenInStats:
    calls: int = 0
    continuations: int = 0  # calls that had a previous LLM call in the same attempt
    token_in: int = 0  # ... whose prompt extended that call's prompt + response exactly

    def count(self, had_previous: bool, extended: bool) -> None:
        self.calls += 1
        self.continuations += had_previous
        self.token_in += extended

    def as_dict(self) -> dict[str, Any]:
        share = self.token_in / self.continuations if self.continuations else None
        return {**self.__dict__, "token_in_share": share}


@dataclass
class AttemptContext:
    """Per-attempt state kept in memory: last call (for token-in), span sequence, rollout facts."""

    rollout_id: str
    attempt_id: str
    kind: RolloutKind
    sampling_seed: int | None
    state: AttemptState
    checked_at: float
    next_sequence: int
    last: LastCall | None = None
    last_ids: array | None = None
    stats: TokenInStats = field(default_factory=TokenInStats)

    def take_sequence(self) -> int:
        self.next_sequence += 1
        return self.next_sequence - 1

    def call_seed(self) -> int | None:
        """Common random numbers: call k of any rollout with the same `sampling_seed` gets the same seed."""
        if self.sampling_seed is None:
            return None
        digest = hashlib.sha256(f"{self.sampling_seed}:{self.stats.calls}".encode()).digest()
        return int.from_bytes(digest[:4], "big") >> 1


class Gateway:
    def __init__(
        self,
        store,
        backend: Backend,
        *,
        secret: str,
        admin_key: str,
        serve_keys: Sequence[str],
        max_body_bytes: int,
        state_ttl_s: float,
        max_contexts: int,
        write_behind_ms: float,
        fsync_spans: bool = False,
    ):
        if not secret or not admin_key:
            raise ValueError("the gateway needs a non-empty secret and admin key")
        self.store = store
        self.backend = backend
        self.secret = secret
        self.admin_key = admin_key
        self.serve_keys = tuple(k for k in serve_keys if k)
        self.max_body_bytes = max_body_bytes
        self.state_ttl_s = state_ttl_s
        self.max_contexts = max_contexts
        self.durable = write_behind_ms <= 0
        self.fsync_spans = fsync_spans
        self.writer = SpanWriter(store, linger_s=max(write_behind_ms, 0) / 1000)
        self.contexts: OrderedDict[str, AttemptContext] = OrderedDict()
        self.sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()  # serve session -> attempt
        self.stats = TokenInStats()
        # attempt key -> (rollout id, attempt id) of keys whose signature already checked out, so the HMAC
        # is computed once per attempt, not per call; only genuine keys enter, and a bounded number.
        self.verified: OrderedDict[str, tuple[str, str]] = OrderedDict()

    # -- request plumbing ---------------------------------------------------------------------------

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

    def caller(self, request: Request) -> Caller:
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if not key:
            raise GatewayError(401, "missing API key (Authorization: Bearer <key>)")
        if same_key(key, self.admin_key):
            return Caller("admin")
        if any(same_key(key, k) for k in self.serve_keys):
            return Caller("serve")
        ids = self.verified.get(key)
        if ids is None:
            ids = parse_attempt_key(self.secret, key)
            if ids is None:
                raise GatewayError(401, "invalid API key")
            self.verified[key] = ids
            if len(self.verified) > self.max_contexts:
                self.verified.popitem(last=False)
        return Caller("attempt", *ids)

    def admin(self, request: Request) -> None:
        if self.caller(request).kind != "admin":
            raise GatewayError(403, "this route needs the admin key")

    async def _load(self, rollout_id: str, attempt_id: str) -> AttemptContext:
        def load() -> AttemptContext:
            try:  # one read: the attempt, its rollout's kind and metadata, and its highest span sequence
                owner, state, kind, metadata, highest = self.store.attempt_facts(attempt_id)
            except NotFound as exc:
                raise GatewayError(404, f"unknown attempt {attempt_id}", code="attempt_not_found") from exc
            if owner != rollout_id:
                raise GatewayError(404, f"attempt {attempt_id} is not an attempt of rollout {rollout_id}")
            seed = metadata.get("sampling_seed")
            return AttemptContext(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                kind=kind,
                sampling_seed=int(seed) if seed is not None else None,
                state=state,
                checked_at=time.monotonic(),
                next_sequence=0 if highest is None else highest + 1,
            )

        return await anyio.to_thread.run_sync(load)

    async def context(
        self, rollout_id: str, attempt_id: str, *, require_running: bool = True
    ) -> AttemptContext:
        ctx = self.contexts.get(attempt_id)
        if ctx is None or ctx.rollout_id != rollout_id:
            loaded = await self._load(rollout_id, attempt_id)
            ctx = self.contexts.setdefault(attempt_id, loaded)  # a racing request may have loaded it first
            if len(self.contexts) > self.max_contexts:
                self.contexts.popitem(last=False)
        else:
            self.contexts.move_to_end(attempt_id)
            if time.monotonic() - ctx.checked_at > self.state_ttl_s:
                attempt = await anyio.to_thread.run_sync(self.store.get_attempt, attempt_id)
                ctx.state, ctx.checked_at = attempt.state, time.monotonic()
        if require_running and ctx.state != AttemptState.running:
            raise GatewayError(
                409, f"attempt {attempt_id} is {ctx.state.value}, not running", code="not_running"
            )
        return ctx

    async def serve_context(self, request: Request, first_user: str) -> AttemptContext:
        session = request.headers.get("x-session-id") or hashlib.sha256(first_user.encode()).hexdigest()[:24]
        ids = self.sessions.get(session)
        if ids is not None:
            try:
                return await self.context(*ids)
            except GatewayError as exc:
                if exc.status != 409:
                    raise
        rollout, attempt = await anyio.to_thread.run_sync(
            self.store.get_or_create_serve_rollout, session, self.backend.resource_id
        )
        self.sessions[session] = (rollout.rollout_id, attempt.attempt_id)
        if len(self.sessions) > self.max_contexts:  # a forgotten session is found again in the store
            self.sessions.popitem(last=False)
        return await self.context(rollout.rollout_id, attempt.attempt_id)

    async def target(
        self, request: Request, caller: Caller, path: dict[str, str], *, first_user: str | None = None
    ) -> AttemptContext:
        """The attempt a call writes to; a key may only write to its own attempt."""
        rid, aid = path.get("rollout_id"), path.get("attempt_id")
        if rid is not None:
            if caller.kind == "attempt" and (caller.rollout_id, caller.attempt_id) != (rid, aid):
                raise GatewayError(403, "this key belongs to another attempt", code="wrong_attempt")
            if caller.kind == "serve":
                raise GatewayError(403, "a serve key cannot write to a rollout attempt")
            return await self.context(rid, aid)
        if caller.kind == "attempt":
            return await self.context(caller.rollout_id, caller.attempt_id)
        if caller.kind == "serve" and first_user is not None:
            return await self.serve_context(request, first_user)
        raise GatewayError(
            400, "name the attempt: use an attempt key or /rollouts/{rid}/attempts/{aid}/v1/..."
        )

    # -- LLM calls ----------------------------------------------------------------------------------

    async def record(self, ctx: AttemptContext, span: Span, *, wait: bool = True, sync: bool = True) -> None:
        span.sequence = ctx.take_sequence()
        if wait and self.writer.idle and self._write_now(span, sync):
            return
        await self.writer.write([span], wait=wait, sync=sync)

    def _write_now(self, span: Span, sync: bool) -> bool:
        """Commit on the event loop when that cannot block it (an unsynced commit to a SQLite file whose
        write lock is free, for a known attempt: ~0.1 ms), saving two thread hand-offs per call. Anything
        else (an fsync takes milliseconds), errors included, is left to the writer thread, which reports
        them."""
        try_add = getattr(self.store, "try_add_spans", None)
        if try_add is None or sync:
            return False
        try:
            return try_add([span], sync=sync)
        except Exception:
            return False

    async def llm_call(self, request: Request, path: dict[str, str], chat: bool) -> Response:
        raw = await self.body(request)
        caller = self.caller(request)
        body = schemas.parse(raw)  # forwarded as sent (upstream mode), after validation
        req = schemas.check(schemas.ChatRequest if chat else schemas.CompletionRequest, body)
        messages = [m.plain() for m in req.messages] if chat else []
        first_user = next((m["content"] or "" for m in messages if m["role"] == "user"), "")
        ctx = await self.target(
            request, caller, path, first_user=first_user if chat else str(req.prompt)[:4096]
        )
        previous, previous_ids = ctx.last, ctx.last_ids
        if chat:
            want_logprobs = bool(req.logprobs)
            sampling = req.sampling(
                ctx.call_seed(), want_logprobs, req.max_completion_tokens or req.max_tokens
            )
        else:
            want_logprobs = req.logprobs is not None and req.logprobs > 0
            sampling = req.sampling(ctx.call_seed(), want_logprobs, req.max_tokens)
        started, t0 = time.time(), time.perf_counter()
        try:
            if chat:
                c = await self.backend.chat(messages, req.tools, req.tool_choice, sampling, previous, body)
            else:
                c = await self.backend.complete(req.single_prompt(), sampling, body)
        except GatewayError as exc:
            if exc.status >= 500:  # the backend failed, not the request: keep the failure on record
                await self.record(ctx, self._error_span(ctx, chat, started, exc))
            raise
        latency = time.perf_counter() - t0
        extended = extends(c.prompt_ids, previous_ids)
        ctx.stats.count(previous_ids is not None, extended)
        self.stats.count(previous_ids is not None, extended)
        span = self._llm_span(ctx, chat, c, sampling, started, latency, extended, bool(req.stream))
        await self.record(ctx, span, wait=self.durable, sync=self.fsync_spans)
        ctx.last_ids = array("i", c.prompt_ids)
        ctx.last_ids.extend(c.response_ids)
        ctx.last = (
            LastCall.of(messages, schemas.assistant_message(c), req.tools, c.prompt_ids, c.response_ids)
            if chat and self.backend.token_in
            else None
        )
        response = (schemas.chat_response if chat else schemas.completion_response)(c, want_logprobs)
        headers = {
            "x-ld-rollout-id": ctx.rollout_id,
            "x-ld-attempt-id": ctx.attempt_id,
            "x-ld-span-id": span.span_id,
        }
        if req.stream:
            stream = schemas.sse(response, include_usage=req.include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        return Response(schemas.dumps(response), media_type="application/json", headers=headers)

    def _llm_span(self, ctx, chat, c: Completion, sampling, started, latency, extended, stream) -> Span:
        return Span(
            trace_id=ctx.attempt_id,
            rollout_id=ctx.rollout_id,
            attempt_id=ctx.attempt_id,
            name="chat.completions" if chat else "completions",
            kind=SpanKind.llm,
            start_time=started,
            end_time=started + latency,
            attributes={
                "model": c.model,
                "backend": self.backend.kind,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": sampling.max_tokens,
                "seed": sampling.seed,
                "stream": stream,
                "token_in": extended,
                "token_source": c.token_source,
                "token_in_share": ctx.stats.as_dict()["token_in_share"],
                "tool_calls": len(c.tool_calls),
                "latency_s": round(latency, 6),
            },
            prompt_token_ids=c.prompt_ids,
            response_token_ids=c.response_ids,
            response_logprobs=c.logprobs,
            finish_reason=c.finish_reason,
            resource_id=self.backend.resource_id,
        )

    def _error_span(self, ctx, chat, started, exc: GatewayError) -> Span:
        return Span(
            trace_id=ctx.attempt_id,
            rollout_id=ctx.rollout_id,
            attempt_id=ctx.attempt_id,
            name="chat.completions" if chat else "completions",
            kind=SpanKind.llm,
            start_time=started,
            end_time=time.time(),
            status="error",
            attributes={"backend": self.backend.kind, "error": exc.message[:500], "http_status": exc.status},
            resource_id=self.backend.resource_id,
        )

    # -- rewards and events -------------------------------------------------------------------------

    async def reward_target(
        self, request: Request, caller: Caller, path: dict, rid: str | None, aid: str | None
    ):
        if caller.kind == "attempt" and not path:
            if rid not in (None, caller.rollout_id) or aid not in (None, caller.attempt_id):
                raise GatewayError(403, "this key belongs to another attempt", code="wrong_attempt")
            return await self.context(caller.rollout_id, caller.attempt_id)
        if path or caller.kind == "attempt":
            return await self.target(request, caller, path)
        if rid is None:
            raise GatewayError(422, "rollout_id: required with a serve or admin key", param="rollout_id")
        if aid is None:
            attempts = await anyio.to_thread.run_sync(lambda: self.store.list_attempts(rollout_id=rid))
            if not attempts:
                raise GatewayError(404, f"unknown rollout {rid}", code="rollout_not_found")
            aid = attempts[-1].attempt_id
        # Serve traffic is judged later: its rewards land whatever the attempt's state.
        ctx = await self.context(rid, aid, require_running=caller.kind == "admin")
        if caller.kind == "serve" and ctx.kind != RolloutKind.serve:
            raise GatewayError(403, "a serve key can reward serve rollouts only")
        return ctx

    async def add_reward(self, ctx: AttemptContext, value: float, judge: str, version: str, unc, extra: dict):
        reward = Reward(
            rollout_id=ctx.rollout_id,
            attempt_id=ctx.attempt_id,
            value=value,
            judge=judge,
            judge_version=version,
            uncertainty=unc,
        )
        # A reward lands after every span acknowledged before it is committed, and its synced commit
        # flushes those spans' unsynced commits to disk with it.
        await self.writer.write([])
        await anyio.to_thread.run_sync(self.store.add_reward, reward)
        attrs = {"value": value, "judge": judge, "judge_version": version}
        attrs.update({k: v for k, v in extra.items() if isinstance(v, str | int | float | bool)})
        return await self.record_event(ctx, "reward", SpanKind.reward, attrs)

    async def record_event(self, ctx: AttemptContext, name: str, kind: SpanKind, attributes: dict) -> dict:
        """Record a reward or custom event as a span of the attempt and acknowledge it."""
        span = Span(
            trace_id=ctx.attempt_id,
            rollout_id=ctx.rollout_id,
            attempt_id=ctx.attempt_id,
            name=name,
            kind=kind,
            end_time=time.time(),
            attributes=attributes,
        )
        await self.record(ctx, span)
        return {
            "status": "ok",
            "rollout_id": ctx.rollout_id,
            "attempt_id": ctx.attempt_id,
            "span_id": span.span_id,
        }

    async def reward(self, request: Request, path: dict) -> dict:
        raw = await self.body(request)
        caller = self.caller(request)
        req = schemas.validate(schemas.RewardRequest, raw)
        ctx = await self.reward_target(request, caller, path, req.rollout_id, req.attempt_id)
        return await self.add_reward(
            ctx, req.value, req.judge, req.judge_version, req.uncertainty, req.model_extra or {}
        )

    async def event(self, request: Request, path: dict) -> dict:
        raw = await self.body(request)
        caller = self.caller(request)
        req = schemas.validate(schemas.EventRequest, raw)
        data = req.data
        ctx = await self.reward_target(request, caller, path, data.get("rollout_id"), data.get("attempt_id"))
        if req.event_type == "reward":
            r = schemas.check(schemas.RewardRequest, data, "data.")
            extra = {k: v for k, v in data.items() if k in ("source", "reason", "message")}
            judge = data.get("judge") or "harness"
            return await self.add_reward(ctx, r.value, judge, r.judge_version, r.uncertainty, extra)
        return await self.record_event(ctx, req.event_type, SpanKind.custom, data)


def create_app(
    store,
    backend: Backend,
    *,
    secret: str,
    admin_key: str,
    serve_keys: Sequence[str] = (),
    max_body_bytes: int = 4 << 20,
    state_ttl_s: float = 0.5,
    max_contexts: int = 10_000,
    write_behind_ms: float = 0.0,
    fsync_spans: bool = False,
) -> FastAPI:
    """The gateway app. `state_ttl_s`: how long an attempt's `running` state is trusted before re-reading it
    from the store (a finished attempt is refused with 409 at most this long after it ends).
    `write_behind_ms` > 0: LLM spans are acknowledged before commit and batched for up to that long (a crash
    loses at most that window; rewards, events and admin reads still wait for everything queued before
    them). 0 (default): every response follows its span's commit. That commit survives a crash of the
    gateway; it is flushed to disk by the next synced commit (the attempt's reward or end, a checkpoint),
    or at every call with `fsync_spans=True` (~1 ms of CPU per call on SQLite)."""
    gw = Gateway(
        store,
        backend,
        secret=secret,
        admin_key=admin_key,
        serve_keys=serve_keys,
        max_body_bytes=max_body_bytes,
        state_ttl_s=state_ttl_s,
        max_contexts=max_contexts,
        write_behind_ms=write_behind_ms,
        fsync_spans=fsync_spans,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            yield
        finally:
            await backend.aclose()
            await anyio.to_thread.run_sync(gw.writer.close)

    app = FastAPI(title="lightning-dagster gateway", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gw

    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        log.info("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return Response(schemas.dumps(exc.body()), status_code=exc.status, media_type="application/json")

    @app.exception_handler(IllegalTransition)
    async def _illegal(request: Request, exc: IllegalTransition) -> Response:
        return await _gateway_error(request, GatewayError(409, str(exc)))

    async def chat_completions(request: Request) -> Response:
        return await gw.llm_call(request, dict(request.path_params), chat=True)

    async def completions(request: Request) -> Response:
        return await gw.llm_call(request, dict(request.path_params), chat=False)

    def routes(prefix: str) -> None:
        # The hot paths are plain Starlette routes: FastAPI's per-request dependency solving is pure overhead
        # for handlers that read the raw body themselves.
        app.add_route(prefix + "/v1/chat/completions", chat_completions, methods=["POST"])
        app.add_route(prefix + "/v1/completions", completions, methods=["POST"])

        @app.get(prefix + "/v1/models")
        async def models(request: Request) -> dict:
            gw.caller(request)
            model = {"id": backend.model, "object": "model", "created": 0, "owned_by": "lightning-dagster"}
            return {"object": "list", "data": [model]}

        @app.post(prefix + "/v1/rewards")
        async def rewards(request: Request) -> dict:
            return await gw.reward(request, dict(request.path_params))

        @app.post(prefix + "/v1/events")
        async def events(request: Request) -> dict:
            return await gw.event(request, dict(request.path_params))

    routes("")
    routes(PREFIX)

    # Agent Lightning's own event URL, so a harness configured for agl-server can post here unchanged.
    @app.post("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events")
    async def agl_events(request: Request) -> dict:
        return await gw.event(request, dict(request.path_params))

    @app.get("/admin/health")
    async def health(request: Request) -> dict:
        gw.admin(request)
        return {"status": "ok", "backend": backend.kind, "model": backend.model, "attempts": len(gw.contexts)}

    @app.get("/admin/stats")
    async def stats(request: Request) -> dict:
        gw.admin(request)
        return {"token_in": gw.stats.as_dict()}

    @app.get("/admin/attempts/{attempt_id}/stats")
    async def attempt_stats(request: Request, attempt_id: str) -> dict:
        gw.admin(request)
        ctx = gw.contexts.get(attempt_id)
        if ctx is None:
            raise GatewayError(404, f"no calls seen for attempt {attempt_id} since the gateway started")
        return {"rollout_id": ctx.rollout_id, "attempt_id": attempt_id, "token_in": ctx.stats.as_dict()}

    @app.get("/admin/attempts/{attempt_id}/spans")
    async def attempt_spans(request: Request, attempt_id: str) -> Response:
        gw.admin(request)
        await gw.writer.write([])  # barrier: spans acknowledged before this request are committed
        spans = await anyio.to_thread.run_sync(lambda: gw.store.list_spans(attempt_id=attempt_id))
        return Response(
            schemas.dumps([s.model_dump(mode="json") for s in spans]), media_type="application/json"
        )

    @app.post("/admin/weights")
    async def load_weights(request: Request) -> dict:
        """A trainer in another process pushes its new policy: the file is read here, so no tensors travel
        over HTTP. Calls sampled after this returns use the new weights and record `resource_id`."""
        gw.admin(request)
        req = schemas.validate(schemas.WeightsRequest, await gw.body(request))
        await anyio.to_thread.run_sync(backend.load_weights, req.path, req.resource_id)
        return {"status": "ok", "model": backend.model, "resource_id": backend.resource_id}

    @app.post("/admin/keys")
    async def mint_key(request: Request) -> dict:
        gw.admin(request)
        raw = await gw.body(request)
        req = schemas.validate(schemas.KeyRequest, raw)
        return {"key": attempt_key(gw.secret, req.rollout_id, req.attempt_id)}

    return app
