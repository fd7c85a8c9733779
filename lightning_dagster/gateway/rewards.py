"""Rewards and custom events (ours and Agent Lightning's event URL): each recorded as a span of its attempt,
a reward also as a `Reward` row in the same transaction, after every span acknowledged before it. A client
retrying a reward sends the same `Idempotency-Key` (or `X-Request-Id`) header on every try: stored once, each
try gets the same answer (the openai client: set `client._idempotency_header = "Idempotency-Key"`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import Request

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.attempts import AttemptContext
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.types import Reward, Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway


REQUEST_ID_HEADERS = ("idempotency-key", "x-request-id")
MAX_REQUEST_ID = 256
REWARD_EXTRAS = ("source", "reason", "message")  # what a reward event's span keeps of its data


def request_id(request: Request) -> str | None:
    """The client's id for this request, the same on each of its retries (None: not sent)."""
    for header in REQUEST_ID_HEADERS:
        value = request.headers.get(header)
        if value is not None:
            if not 0 < len(value) <= MAX_REQUEST_ID:
                raise GatewayError(
                    422, f"{header}: 1 to {MAX_REQUEST_ID} characters, got {len(value)}", param=header
                )
            return value
    return None


async def add_reward(
    gw: Gateway, ctx: AttemptContext, req: schemas.RewardRequest, extra: dict, retry_id: str | None
) -> dict:
    reward = Reward(
        rollout_id=ctx.rollout_id, attempt_id=ctx.attempt_id, value=req.value, judge=req.judge,
        judge_version=req.judge_version, uncertainty=req.uncertainty,
    )  # fmt: skip
    attrs = {"value": req.value, "judge": req.judge, "judge_version": req.judge_version}
    attrs.update({k: v for k, v in extra.items() if isinstance(v, str | int | float | bool)})
    if retry_id is not None:
        attrs["request_id"] = retry_id
    span = attempt_span(ctx, "reward", SpanKind.reward, attrs)
    span.sequence = ctx.take_sequence()
    # A reward lands after every span acknowledged before it is committed, and its synced commit
    # flushes those spans' unsynced commits to disk with it.
    await gw.writer.write([])
    stored = await anyio.to_thread.run_sync(
        lambda: gw.store.add_reward(reward, span=span, request_id=retry_id)
    )
    return _ack(ctx, stored)


def attempt_span(ctx: AttemptContext, name: str, kind: SpanKind, attributes: dict, **fields: Any) -> Span:
    """A span of the attempt, ending now unless `fields` say otherwise."""
    fields.setdefault("end_time", time.time())
    return Span(
        trace_id=ctx.attempt_id, rollout_id=ctx.rollout_id, attempt_id=ctx.attempt_id, name=name, kind=kind,
        attributes=attributes, **fields,
    )  # fmt: skip


def _ack(ctx: AttemptContext, span_id: str | None) -> dict:
    return {"status": "ok", "rollout_id": ctx.rollout_id, "attempt_id": ctx.attempt_id, "span_id": span_id}


async def reward(gw: Gateway, request: Request, path: dict) -> dict:
    raw = await gw.body(request)
    caller = gw.attempts.caller(request)
    req = schemas.validate(schemas.RewardRequest, raw)
    retry_id = request_id(request)
    ctx = await gw.attempts.reward_target(request, caller, path, req.rollout_id, req.attempt_id)
    return await add_reward(gw, ctx, req, req.model_extra or {}, retry_id)


async def event(gw: Gateway, request: Request, path: dict) -> dict:
    raw = await gw.body(request)
    caller = gw.attempts.caller(request)
    req = schemas.validate(schemas.EventRequest, raw)
    retry_id = request_id(request)
    data = req.data
    ctx = await gw.attempts.reward_target(
        request, caller, path, data.get("rollout_id"), data.get("attempt_id")
    )
    return _ack(ctx, await record_event(gw, ctx, req.event_type, data, retry_id))


async def record_event(
    gw: Gateway, ctx: AttemptContext, event_type: str, data: dict, retry_id: str | None, *, sync: bool = True
) -> str | None:
    """An event of the attempt: a reward (`data` as a `RewardRequest`), else a custom span; its span id."""
    if event_type == "reward":
        r = schemas.check(schemas.RewardRequest, data, "data.")
        extra = {k: v for k, v in data.items() if k in REWARD_EXTRAS}
        return (await add_reward(gw, ctx, r, extra, retry_id))["span_id"]
    span = attempt_span(ctx, event_type, SpanKind.custom, data)
    await gw.record(ctx, span, sync=sync)
    return span.span_id
