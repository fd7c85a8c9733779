"""Rewards and custom events (ours and Agent Lightning's event URL): each recorded as a span of its attempt,
a reward also as a `Reward` row, after every span acknowledged before it is committed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import anyio
from fastapi import Request

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.attempts import AttemptContext
from lightning_dagster.types import Reward, Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway


async def add_reward(
    gw: Gateway,
    ctx: AttemptContext,
    value: float,
    judge: str,
    version: str,
    uncertainty: float | None,
    extra: dict,
) -> dict:
    reward = Reward(
        rollout_id=ctx.rollout_id,
        attempt_id=ctx.attempt_id,
        value=value,
        judge=judge,
        judge_version=version,
        uncertainty=uncertainty,
    )
    # A reward lands after every span acknowledged before it is committed, and its synced commit
    # flushes those spans' unsynced commits to disk with it.
    await gw.writer.write([])
    await anyio.to_thread.run_sync(gw.store.add_reward, reward)
    attrs = {"value": value, "judge": judge, "judge_version": version}
    attrs.update({k: v for k, v in extra.items() if isinstance(v, str | int | float | bool)})
    return await record_event(gw, ctx, "reward", SpanKind.reward, attrs)


async def record_event(gw: Gateway, ctx: AttemptContext, name: str, kind: SpanKind, attributes: dict) -> dict:
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
    await gw.record(ctx, span)
    return {
        "status": "ok",
        "rollout_id": ctx.rollout_id,
        "attempt_id": ctx.attempt_id,
        "span_id": span.span_id,
    }


async def reward(gw: Gateway, request: Request, path: dict) -> dict:
    raw = await gw.body(request)
    caller = gw.attempts.caller(request)
    req = schemas.validate(schemas.RewardRequest, raw)
    ctx = await gw.attempts.reward_target(request, caller, path, req.rollout_id, req.attempt_id)
    return await add_reward(
        gw, ctx, req.value, req.judge, req.judge_version, req.uncertainty, req.model_extra or {}
    )


async def event(gw: Gateway, request: Request, path: dict) -> dict:
    raw = await gw.body(request)
    caller = gw.attempts.caller(request)
    req = schemas.validate(schemas.EventRequest, raw)
    data = req.data
    ctx = await gw.attempts.reward_target(
        request, caller, path, data.get("rollout_id"), data.get("attempt_id")
    )
    if req.event_type == "reward":
        r = schemas.check(schemas.RewardRequest, data, "data.")
        extra = {k: v for k, v in data.items() if k in ("source", "reason", "message")}
        judge = data.get("judge") or "harness"
        return await add_reward(gw, ctx, r.value, judge, r.judge_version, r.uncertainty, extra)
    return await record_event(gw, ctx, req.event_type, SpanKind.custom, data)
