"""Agent Lightning's events over our spans: `POST /api/rollouts/{rid}/attempt/{aid}/events` records one (a
reward, an LLM span for a `model_request` with token ids, else a custom span); `GET /api/rollouts/{rid}/
events` rebuilds them from the rollout's current attempt's spans (`format=triplet`: trimmed for training)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import anyio
from cachetools import LRUCache
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lightning_dagster.gateway import rewards as gateway_events
from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.agl import Agl, reply
from lightning_dagster.gateway.attempts import RolloutDeleted
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.keys import request_key
from lightning_dagster.store import agl_rollouts as store_agl
from lightning_dagster.types import Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway

REWARD_EXTRAS = ("source", "reason", "message")


def _int_list(value: Any, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise GatewayError(422, f"{where}: expected a list of non-negative integer token ids", param=where)
    return value


def _ids(response: Any) -> tuple[list[int] | None, list[int] | None, list[float] | None]:
    """Prompt ids, response ids and logprobs of a vLLM-shaped `data.response` (`prompt_token_ids` at the top
    or on the first choice, `choices[0].token_ids`, `choices[0].logprobs`), checked: malformed ones are a
    422 naming the field (they would otherwise become an LLM span the trainer reads)."""
    if not isinstance(response, dict) or not response.get("choices"):
        return None, None, None
    where = "data.response.choices"
    choices = response["choices"]
    if not isinstance(choices, list) or not isinstance(choices[0], dict):
        raise GatewayError(422, f"{where}: expected a list of choice objects", param=where)
    choice = choices[0]
    prompt = _int_list(
        response.get("prompt_token_ids") or choice.get("prompt_token_ids"), "data.response.prompt_token_ids"
    )
    tokens = _int_list(choice.get("token_ids"), f"{where}.0.token_ids")
    lp, logprobs = choice.get("logprobs"), None
    if isinstance(lp, dict) and lp.get("content") is not None:
        content = lp["content"]
        if not isinstance(content, list) or not all(
            isinstance(t, dict) and _number(t.get("logprob")) for t in content
        ):
            raise GatewayError(
                422, f"{where}.0.logprobs.content: expected objects with a numeric logprob", param=where
            )
        logprobs = [float(t["logprob"]) for t in content]
    elif isinstance(lp, dict) and lp.get("token_logprobs") is not None:
        logprobs = lp["token_logprobs"]
        if not isinstance(logprobs, list) or not all(_number(x) for x in logprobs):
            raise GatewayError(
                422, f"{where}.0.logprobs.token_logprobs: expected a list of numbers", param=where
            )
        logprobs = [float(x) for x in logprobs]
    if logprobs is not None and tokens is not None and len(logprobs) != len(tokens):
        raise GatewayError(
            422,
            f"{where}.0.logprobs: {len(logprobs)} logprobs for {len(tokens)} token ids",
            param=f"{where}.0.logprobs",
        )
    return prompt, tokens, logprobs


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _model_request_span(ctx, data: dict) -> Span | None:
    """A posted `model_request` with token ids as an LLM span (None: it carries none)."""
    prompt, response, logprobs = _ids(data.get("response"))
    if not prompt or not response:
        return None
    attributes = {k: v for k, v in data.items() if k != "response"}
    attributes["posted"] = True
    status = "error" if data.get("status") == "error" else "ok"
    return gateway_events._span(
        ctx, "model_request", SpanKind.llm, attributes, status=status, prompt_token_ids=prompt,
        response_token_ids=response, response_logprobs=logprobs,
        finish_reason=_finish_reason(data.get("finish_reason")),
    )  # fmt: skip


def _finish_reason(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise GatewayError(422, "data.finish_reason: expected a string", param="data.finish_reason")
    return value


def as_event(span: Span, name: str) -> dict[str, Any]:
    """Agent Lightning's raw `Event` for one span of the attempt it names `name`."""
    attrs = span.attributes or {}
    when = span.end_time or span.start_time
    base = {"rollout_id": span.rollout_id, "attempt_id": name, "timestamp": when}
    if span.kind is SpanKind.reward:
        data = {"value": attrs.get("value"), **{k: attrs[k] for k in REWARD_EXTRAS if k in attrs}}
        return {"event_type": "reward", **base, "data": data}
    if span.kind is not SpanKind.llm:
        return {"event_type": span.name, **base, "data": attrs}
    if span.status == "error":
        response: dict[str, Any] = {"error": attrs.get("error")}
    else:
        lp = span.response_logprobs
        choice = {
            "index": 0,
            "token_ids": span.response_token_ids,
            "logprobs": None if lp is None else {"content": [{"logprob": x} for x in lp]},
            "finish_reason": span.finish_reason,
        }
        response = {"prompt_token_ids": span.prompt_token_ids, "choices": [choice]}
    model = attrs.get("model")
    data = {
        "model": model,
        "request": {k: attrs.get(k) for k in ("temperature", "top_p", "max_tokens")},
        "server": {"model": model, "version": span.resource_id},
        "latency_ms": attrs["latency_s"] * 1e3 if "latency_s" in attrs else None,
        "http_status": attrs.get("http_status", 200 if span.status == "ok" else 500),
        "status": "ok" if span.status == "ok" else "error",
        "finish_reason": span.finish_reason,
    }
    if attrs.get("posted"):
        data.update({k: v for k, v in attrs.items() if k != "posted"})
    return {"event_type": "model_request", **base, "data": {**data, "response": response}}


def as_triplet(event: dict[str, Any]) -> dict[str, Any]:
    """The event trimmed as Agent Lightning's `format=triplet` (model requests and rewards)."""
    data = event["data"]
    if event["event_type"] == "model_request":
        prompt, response, logprobs = _ids(data.get("response"))
        trimmed = {
            "prompt_token_ids": prompt or [],
            "response_token_ids": response or [],
            "response_log_probs": logprobs,
            "server": {"model": data["server"].get("model"), "version": data["server"].get("version")},
            "http_status": data["http_status"],
            "status": data["status"],
        }
        if "error" in data["response"]:
            trimmed["error"] = data["response"]["error"]
        return {**event, "data": trimmed}
    if event["event_type"] == "reward":
        return {**event, "data": {k: v for k, v in data.items() if k in ("value", "source", "reason")}}
    return event


def last_per_prompt(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of model requests with the same prompt ids keep the last (a retried call); the rest unchanged."""
    last: dict[tuple[int, ...], int] = {}
    for i, e in enumerate(events):
        if e["event_type"] == "model_request" and e["data"]["prompt_token_ids"]:
            last[tuple(e["data"]["prompt_token_ids"])] = i
    kept = set(last.values())
    return [
        e
        for i, e in enumerate(events)
        if e["event_type"] != "model_request" or not e["data"]["prompt_token_ids"] or i in kept
    ]


def routes(app: FastAPI, gw: Gateway, agl: Agl) -> list[tuple[str, Any, str]]:
    """(path, endpoint, method) of this module's routes."""
    store = gw.store
    # (rollout, attempt, span count, highest sequence, event_type, format) -> the answer's JSON
    rendered: LRUCache[tuple, bytes] = LRUCache(1_000)

    async def post_event(request: Request) -> Response:
        path = dict(request.path_params)
        key = request_key(request)
        if key and not agl.is_server_key(key):  # an attempt key: the gateway's own event route
            return reply(await gateway_events.event(gw, request, path))
        agl.check(request)
        raw = await gw.body(request)
        req = schemas.validate(schemas.EventRequest, raw)
        retry_id = gateway_events.request_id(request)
        target = await agl.target(store, path["rollout_id"], path["attempt_id"])
        try:
            ctx = await gw.attempts.context(path["rollout_id"], target.attempt_id, require_running=False)
        except RolloutDeleted:  # through another replica: what this one cached of it goes too
            agl.moved(path["rollout_id"])
            raise
        data = req.data
        if req.event_type == "reward":
            r = schemas.check(schemas.RewardRequest, data, "data.")
            extra = {k: v for k, v in data.items() if k in REWARD_EXTRAS}
            await gateway_events.add_reward(gw, ctx, r, extra, retry_id)
        elif req.event_type == "model_request" and (span := _model_request_span(ctx, data)) is not None:
            await gw.record(ctx, span, sync=gw.fsync_spans)
        else:
            span = gateway_events._span(ctx, req.event_type, SpanKind.custom, data)
            await gw.record(ctx, span, sync=gw.fsync_spans)
        event = {
            "event_type": req.event_type,
            "rollout_id": ctx.rollout_id,
            "attempt_id": target.name,
            "timestamp": time.time(),
            "data": data,
        }
        return reply(event)

    async def get_events(request: Request) -> Response:
        agl.check(request)
        rid = request.path_params["rollout_id"]
        event_type = request.query_params.get("event_type")
        fmt = request.query_params.get("format")
        if fmt not in (None, "triplet"):
            raise GatewayError(422, f"format: {fmt!r} is not 'triplet'", param="format")

        if not gw.writer.idle:  # spans acknowledged before this read are committed first
            await gw.writer.write([], sync=False)

        def where() -> tuple:
            """The current attempt and what its spans are now (spans are only added, never changed)."""
            if not store_agl.exists(store, rid):
                raise GatewayError(404, f"rollout {rid} not found")
            attempts = store_agl.attempt_ids(store, rid)
            if not attempts:
                return ()
            latest = (attempts[-1], str(len(attempts) - 1))  # our id, Agent Lightning's name
            return (rid, *latest, *store_agl.span_marker(store, attempts[-1]), event_type, fmt)

        key = where() if store.raw_reads else await anyio.to_thread.run_sync(where)
        body = rendered.get(key) if key else b"[]"
        if body is None:
            spans = await anyio.to_thread.run_sync(lambda: store.list_spans(attempt_id=key[1]))
            events = [as_event(s, key[2]) for s in spans]
            if event_type is not None:
                events = [e for e in events if e["event_type"] == event_type]
            if fmt == "triplet":
                events = last_per_prompt([as_triplet(e) for e in events])
            body = rendered[key] = schemas.dumps(events)
        return Response(body, media_type="application/json")

    return [
        ("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", post_event, "POST"),
        ("/api/rollouts/{rollout_id}/events", get_events, "GET"),
    ]
