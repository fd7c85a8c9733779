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
from lightning_dagster.gateway.rewards import REWARD_EXTRAS
from lightning_dagster.store import agl_rollouts as store_agl
from lightning_dagster.types import Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway


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
    lp = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
    logprobs = None
    if lp.get("content") is not None:
        content = lp["content"]
        if isinstance(content, list) and all(isinstance(t, dict) for t in content):
            logprobs = [t.get("logprob") for t in content]
        if logprobs is None or not all(map(_number, logprobs)):
            message = "content: expected objects with a numeric logprob"
            raise GatewayError(422, f"{where}.0.logprobs.{message}", param=where)
    elif lp.get("token_logprobs") is not None:
        logprobs = lp["token_logprobs"]
        if not isinstance(logprobs, list) or not all(map(_number, logprobs)):
            message = "token_logprobs: expected a list of numbers"
            raise GatewayError(422, f"{where}.0.logprobs.{message}", param=where)
    logprobs = [float(x) for x in logprobs] if logprobs is not None else None
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
    finish = data.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise GatewayError(422, "data.finish_reason: expected a string", param="data.finish_reason")
    attributes = {**{k: v for k, v in data.items() if k != "response"}, "posted": True}
    status = "error" if data.get("status") == "error" else "ok"
    return gateway_events.attempt_span(
        ctx, "model_request", SpanKind.llm, attributes, status=status, prompt_token_ids=prompt,
        response_token_ids=response, response_logprobs=logprobs, finish_reason=finish,
    )  # fmt: skip


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

    def key(i: int, e: dict[str, Any]) -> Any:  # the prompt ids, or the event's own position
        ids = e["event_type"] == "model_request" and e["data"]["prompt_token_ids"]
        return tuple(ids) if ids else i

    kept = set({key(i, e): i for i, e in enumerate(events)}.values())
    return [e for i, e in enumerate(events) if i in kept]


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
        if req.event_type == "model_request" and (span := _model_request_span(ctx, data)) is not None:
            await gw.record(ctx, span, sync=gw.fsync_spans)
        else:
            await gateway_events.record_event(gw, ctx, req.event_type, data, retry_id, sync=gw.fsync_spans)
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
        return reply(body)

    return [
        ("/api/rollouts/{rollout_id}/attempt/{attempt_id}/events", post_event, "POST"),
        ("/api/rollouts/{rollout_id}/events", get_events, "GET"),
    ]
