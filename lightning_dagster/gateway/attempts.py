"""Attribution: which attempt a request writes to (per-attempt key, path, or serve session), and the state the
gateway keeps per attempt (last call for token-in, span sequence, the rollout's seed and sampling).

That state is a cache of the store: a context loaded for an attempt that already has spans is rebuilt from
them, the last call's conversation matched by the digest its span records (`conversation`), so token-in
continues exactly. Over a PostgreSQL store every call re-reads the attempt's state, rollout harness and
highest span sequence, and catches up when another replica wrote meanwhile (or ended or deleted it).

Serve sessions: a call names its session in `X-Session-Id` (1 to 256 characters); a call without one opens
a new session, whose id the response returns. A session belongs to the serve key that opened it (another
key naming it: 403); sessions are never matched by content."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from cachetools import LRUCache
from fastapi import Request
from pydantic import ValidationError

from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.keys import GatewayKeys, parse_attempt_key, request_key, same_key
from lightning_dagster.gateway.options import GatewayOptions
from lightning_dagster.gateway.tokenin import LastCall, TokenInStats, normalize_messages
from lightning_dagster.store.agl_rollouts import DELETED
from lightning_dagster.store.errors import NotFound
from lightning_dagster.types import AttemptState, RolloutKind, Sampling, Span, SpanKind

MAX_SESSION_ID = 256  # the store's session column


@dataclass
class Caller:
    kind: str  # attempt | serve | admin
    rollout_id: str | None = None
    attempt_id: str | None = None
    key_id: str | None = None  # serve keys: a digest that names the key without revealing it


def _digest(normalized: list[dict], tools: list[dict] | None) -> str:
    text = json.dumps([normalized, tools], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def conversation(last: LastCall) -> dict[str, Any]:
    """What an LLM span records of its call's conversation so any replica can continue it exactly: message
    count, digest, and the reply as JSON text (escaped: the store refuses raw NULs)."""
    return {
        "messages": len(last.messages),
        "digest": _digest(last.messages, last.tools),
        "assistant": json.dumps(last.raw_messages[-1]),
    }


class RolloutDeleted(GatewayError):
    """A call to an attempt of a rollout deleted through Agent Lightning's API: 404, as that API answers."""

    def __init__(self, rollout_id: str):
        super().__init__(404, f"rollout {rollout_id!r} not found")


@dataclass
class AttemptContext:
    """Per-attempt state kept in memory: last call (for token-in), span sequence, rollout facts."""

    rollout_id: str
    attempt_id: str
    kind: RolloutKind
    sampling_seed: int | None
    sampling: Sampling | None  # the rollout's decided sampling; None: each call's own request decides
    policy_version: int | None  # the published policy version its calls must sample from (None: any)
    state: AttemptState
    checked_at: float = field(default_factory=time.monotonic)
    next_sequence: int = 0
    harness: str | None = None  # the rollout's, as last read (`store.agl.DELETED`: deleted, refused)
    last: LastCall | None = None
    last_ids: array | None = None
    session: str | None = None  # serve rollouts: the client's session id
    stats: TokenInStats = field(default_factory=TokenInStats)
    # the last call as its span recorded it (`conversation`), when the context was rebuilt from the store;
    # `resume` turns it into `last` once the next request's messages are known
    recorded: dict[str, Any] | None = None

    def resume(self, messages: list[dict], tools: list[dict] | None) -> None:
        """Rebuild `last` from the recorded last call if `messages` continue its conversation."""
        recorded, self.recorded = self.recorded, None
        if recorded is None or self.last_ids is None:
            return
        n = recorded["messages"]
        if len(messages) <= n:
            return
        raw = [*messages[: n - 1], json.loads(recorded["assistant"])]
        normalized = normalize_messages(raw)
        if _digest(normalized, tools) == recorded["digest"]:
            self.last = LastCall(normalized, raw, tools, self.last_ids)

    def take_sequence(self) -> int:
        self.next_sequence += 1
        return self.next_sequence - 1

    def call_seed(self) -> int | None:
        """Common random numbers: call k of any rollout with the same `sampling_seed` gets the same seed."""
        if self.sampling_seed is None:
            return None
        digest = hashlib.sha256(f"{self.sampling_seed}:{self.stats.calls}".encode()).digest()
        return int.from_bytes(digest[:4], "big") >> 1


class Attempts:
    """Keys -> callers, callers + paths -> attempt contexts; bounded LRU caches of contexts, serve sessions
    and verified keys (a forgotten entry is read again from the store)."""

    def __init__(self, store, backend, keys: GatewayKeys, options: GatewayOptions):
        self.store = store
        self.backend = backend
        self.secret = keys.secret
        self.admin_key = keys.admin_key
        self.serve_keys = tuple(k for k in keys.serve_keys if k)
        self.state_ttl_s = options.state_ttl_s
        max_contexts = options.max_contexts
        # replicas share attempts only through a server database; a SQLite file is one host's
        self.shared = store.engine.url.get_backend_name() != "sqlite"
        self.contexts: LRUCache[str, AttemptContext] = LRUCache(max_contexts)
        # serve session -> (key id of its owner, rollout id, attempt id)
        self.sessions: LRUCache[str, tuple[str, str, str]] = LRUCache(max_contexts)
        # attempt key -> (rollout id, attempt id) of keys whose signature already checked out, so the HMAC
        # is computed once per attempt, not per call; only genuine keys enter.
        self.verified: LRUCache[str, tuple[str, str]] = LRUCache(max_contexts)

    def caller(self, request: Request) -> Caller:
        key = request_key(request)
        if not key:
            raise GatewayError(401, "missing API key (Authorization: Bearer <key>)")
        if same_key(key, self.admin_key):
            return Caller("admin")
        if any(same_key(key, k) for k in self.serve_keys):
            return Caller("serve", key_id=hashlib.sha256(key.encode()).hexdigest()[:16])
        ids = self.verified.get(key)
        if ids is None:
            ids = parse_attempt_key(self.secret, key)
            if ids is None:
                raise GatewayError(401, "invalid API key")
            self.verified[key] = ids
        return Caller("attempt", *ids)

    def require_admin(self, request: Request) -> None:
        if self.caller(request).kind != "admin":
            raise GatewayError(403, "this route needs the admin key")

    async def _load(self, rollout_id: str, attempt_id: str) -> AttemptContext:
        def load() -> AttemptContext:
            try:  # one read: the attempt, its rollout's kind and metadata, and its highest span sequence
                owner, state, kind, metadata, highest, harness = self.store.attempt_facts(attempt_id)
            except NotFound as exc:
                raise GatewayError(404, f"unknown attempt {attempt_id}", code="attempt_not_found") from exc
            if owner != rollout_id:
                raise GatewayError(404, f"attempt {attempt_id} is not an attempt of rollout {rollout_id}")
            seed, sampling = metadata.get("sampling_seed"), metadata.get("sampling")
            version = metadata.get("policy_version")
            try:
                decided = Sampling.model_validate(sampling) if sampling is not None else None
            except ValidationError as exc:
                raise GatewayError(
                    500, f"rollout {rollout_id} has an invalid metadata.sampling: {exc}"
                ) from exc
            seed, version = (int(x) if x is not None else None for x in (seed, version))
            ctx = AttemptContext(rollout_id, attempt_id, kind, seed, decided, version, state, harness=harness)
            if highest is not None:
                self._catch_up(ctx, highest)
            return ctx

        return await anyio.to_thread.run_sync(load)

    def _catch_up(self, ctx: AttemptContext, highest: int) -> None:
        """Rebuild what the attempt's recorded spans say (see the module docstring); blocking."""
        calls = [
            s
            for s in self.store.list_spans(attempt_id=ctx.attempt_id, kind=SpanKind.llm)
            if s.status == "ok" and s.prompt_token_ids is not None
        ]
        ctx.next_sequence = highest + 1
        ctx.stats = TokenInStats(
            calls=len(calls),
            continuations=max(len(calls) - 1, 0),
            token_in=sum(bool(s.attributes.get("token_in")) for s in calls),
            fallbacks=sum(bool(s.attributes.get("token_in_fallback")) for s in calls),
        )
        ctx.last = ctx.last_ids = ctx.recorded = None
        if calls:
            last: Span = calls[-1]
            ctx.last_ids = array("i", [*last.prompt_token_ids, *(last.response_token_ids or [])])
            ctx.recorded = last.attributes.get("conversation")

    async def _refresh(self, ctx: AttemptContext) -> None:
        """Shared store: the attempt's state, and what another replica recorded since our last call."""

        def refresh() -> None:
            _, state, _, _, highest, harness = self.store.attempt_facts(ctx.attempt_id)
            ctx.state, ctx.harness, ctx.checked_at = state, harness, time.monotonic()
            if highest is not None and highest >= ctx.next_sequence:
                self._catch_up(ctx, highest)

        await anyio.to_thread.run_sync(refresh)

    async def context(
        self, rollout_id: str, attempt_id: str, *, require_running: bool = True
    ) -> AttemptContext:
        ctx = self.contexts.get(attempt_id)  # a hit also marks the context recently used
        if ctx is None or ctx.rollout_id != rollout_id:
            loaded = await self._load(rollout_id, attempt_id)
            ctx = self.contexts.setdefault(attempt_id, loaded)  # a racing request may have loaded it first
        elif self.shared:
            await self._refresh(ctx)
        elif require_running and time.monotonic() - ctx.checked_at > self.state_ttl_s:
            # only a caller that needs `running` needs the state fresh (it re-reads a stale one)
            attempt = await anyio.to_thread.run_sync(self.store.get_attempt, attempt_id)
            ctx.state, ctx.checked_at = attempt.state, time.monotonic()
        # Checked here, when the call is accepted, not by the span insert: a span accepted before the delete
        # and committed after it (a batch, a write-behind) is kept, and the check rides on the read a
        # shared store makes anyway (a file store's contexts are marked by the delete: `changed`).
        if ctx.harness == DELETED:
            raise RolloutDeleted(rollout_id)
        if require_running and ctx.state != AttemptState.running:
            raise GatewayError(
                409, f"attempt {attempt_id} is {ctx.state.value}, not running", code="not_running"
            )
        return ctx

    def changed(self, attempt_ids: Sequence[str], *, deleted: bool = False) -> None:
        """These attempts moved through this gateway (re-read their state) or their rollout was deleted
        (refuse them). Marked, not dropped: a reload could hand out a span sequence a call in flight holds."""
        for aid in attempt_ids:
            ctx = self.contexts.get(aid)
            if ctx is not None:
                ctx.checked_at = -math.inf
                if deleted:
                    ctx.harness = DELETED

    async def serve_context(self, request: Request, caller: Caller) -> AttemptContext:
        """The attempt of the serve session `X-Session-Id` names (opened with this key), or of a new one."""
        session = request.headers.get("x-session-id")
        if session is None:
            session = secrets.token_urlsafe(18)
        elif not 0 < len(session) <= MAX_SESSION_ID:
            raise GatewayError(
                422,
                f"X-Session-Id: 1 to {MAX_SESSION_ID} characters, got {len(session)}",
                param="X-Session-Id",
            )
        cached = self.sessions.get(session)
        if cached is not None:
            self._own(cached[0], caller)
            try:
                return await self.context(*cached[1:])
            except GatewayError as exc:
                if exc.status != 409:
                    raise
        rollout, attempt = await anyio.to_thread.run_sync(
            lambda: self.store.get_or_create_serve_rollout(
                session, self.backend.resource_id, owner=caller.key_id
            )
        )
        owner = rollout.metadata.get("owner")
        self._own(owner, caller)
        self.sessions[session] = (owner, rollout.rollout_id, attempt.attempt_id)
        ctx = await self.context(rollout.rollout_id, attempt.attempt_id)
        ctx.session = session
        return ctx

    @staticmethod
    def _own(owner: str | None, caller: Caller) -> None:
        if owner != caller.key_id:
            raise GatewayError(403, "this session was opened with another serve key", code="wrong_session")

    async def target(
        self, request: Request, caller: Caller, path: dict[str, str], *, serve: bool = False
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
        if caller.kind == "serve" and serve:
            return await self.serve_context(request, caller)
        raise GatewayError(
            400, "name the attempt: use an attempt key or /rollouts/{rid}/attempts/{aid}/v1/..."
        )

    async def reward_target(
        self, request: Request, caller: Caller, path: dict, rid: str | None, aid: str | None
    ) -> AttemptContext:
        """The attempt a reward or event is for: the key's, the path's, or the named rollout's latest."""
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
