"""The LLM routes (chat and completions, streamed or not): the rollout's sampling applied over the request's,
one backend call, one LLM span with the exact ids, then the OpenAI-shaped response."""

from __future__ import annotations

import dataclasses
import time
from array import array
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.attempts import AttemptContext, conversation
from lightning_dagster.gateway.backends import CallSampling
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.rewards import attempt_span
from lightning_dagster.gateway.tokenin import LastCall, continues, extends
from lightning_dagster.gateway.upstreams import UPSTREAM_REFUSED
from lightning_dagster.gateway.weightsync import ServedWeights
from lightning_dagster.types import Sampling, Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway


def apply_rollout_sampling(requested: CallSampling, decided: Sampling | None) -> CallSampling:
    """The sampling a call runs with: the rollout's decided sampling over whatever the harness asked."""
    if decided is None:
        return requested
    return dataclasses.replace(
        requested,
        temperature=decided.temperature,
        top_p=decided.top_p,
        max_tokens=decided.max_tokens if decided.max_tokens is not None else requested.max_tokens,
    )


async def llm_call(gw: Gateway, request: Request, path: dict[str, str], chat: bool) -> Response:
    raw = await gw.body(request)
    caller = gw.attempts.caller(request)
    body = schemas.parse(raw)  # forwarded (upstream mode) with the applied sampling, after validation
    req = schemas.check(schemas.ChatRequest if chat else schemas.CompletionRequest, body)
    gw.check_model(req.model)
    messages = [m.plain() for m in req.messages] if chat else []
    ctx = await gw.attempts.target(request, caller, path, serve=True)
    ctx.resume(messages, req.tools if chat else None)  # a context rebuilt from the store (another replica's)
    previous, previous_ids = ctx.last, ctx.last_ids
    want_logprobs = bool(req.logprobs)  # chat: a flag; completions: how many per token (0: none)
    max_tokens = (req.max_completion_tokens if chat else None) or req.max_tokens
    requested = {"temperature": req.temperature, "top_p": req.top_p, "max_tokens": max_tokens}
    sampling = apply_rollout_sampling(req.sampling(ctx.call_seed(), want_logprobs, max_tokens), ctx.sampling)
    served = await gw.weights.enter(ctx.policy_version)  # held until sampled: no swap meanwhile
    started, t0 = time.time(), time.perf_counter()
    backend = gw.backend
    try:
        if chat:
            c = await backend.chat(
                messages, req.tools, req.tool_choice, sampling, previous, body, route=ctx.rollout_id
            )
        else:
            c = await backend.complete(req.single_prompt(), sampling, body, route=ctx.rollout_id)
    except GatewayError as exc:
        # the backend failed, or the upstream refused the call: either way the call stays on the record
        if exc.status >= 500 or exc.code == UPSTREAM_REFUSED:
            await gw.record(ctx, _error_span(gw, ctx, chat, started, exc, served))
        raise
    finally:
        gw.weights.leave()
    latency = time.perf_counter() - t0
    extended = extends(c.prompt_ids, previous_ids)
    # the conversation continued but the prompt does not extend the last call's ids: the template rewrote
    # earlier turns, so the prompt was rendered afresh (and recorded as rendered, the ids the model saw)
    fallback = not extended and continues(previous, messages, req.tools if chat else None)
    ctx.stats.count(previous_ids is not None, extended, fallback)
    gw.stats.count(previous_ids is not None, extended, fallback)
    attributes = {
        "model": c.model,
        "requested_model": req.model,  # the name the agent sent (None: none)
        "backend": backend.kind,
        "upstream": c.upstream,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "requested": requested,  # what the harness asked (None: not sent)
        "seed": sampling.seed,
        "stream": bool(req.stream),
        "token_in": extended,
        "token_in_fallback": fallback,
        "token_source": c.token_source,
        "token_in_share": ctx.stats.as_dict()["token_in_share"],
        "tool_calls": len(c.tool_calls),
        "latency_s": round(latency, 6),
        "weights": served.attributes(),  # the weights that sampled this call
    }
    last = (
        LastCall.of(messages, schemas.assistant_message(c), req.tools, c.prompt_ids, c.response_ids)
        if chat and backend.token_in
        else None
    )
    if last is not None:
        attributes["conversation"] = conversation(last)
    span = _call_span(
        ctx, chat, started, served, attributes, end_time=started + latency,
        prompt_token_ids=c.prompt_ids, response_token_ids=c.response_ids, response_logprobs=c.logprobs,
        finish_reason=c.finish_reason,
    )  # fmt: skip
    await gw.record(ctx, span, wait=gw.durable, sync=gw.fsync_spans)
    ctx.last_ids = array("i", [*c.prompt_ids, *c.response_ids])
    ctx.last = last
    response = (schemas.chat_response if chat else schemas.completion_response)(c, want_logprobs)
    headers = {
        "x-ld-rollout-id": ctx.rollout_id,
        "x-ld-attempt-id": ctx.attempt_id,
        "x-ld-span-id": span.span_id,
    }
    if ctx.session is not None:
        headers["x-session-id"] = ctx.session
    if req.stream:
        stream = schemas.sse(response, include_usage=req.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    return Response(schemas.dumps(response), media_type="application/json", headers=headers)


def _call_span(
    ctx: AttemptContext, chat: bool, started: float, served: ServedWeights, attributes: dict, **fields: Any
) -> Span:
    """An LLM span of this attempt's call, sampled from `served`."""
    name = "chat.completions" if chat else "completions"
    return attempt_span(
        ctx, name, SpanKind.llm, attributes, start_time=started, resource_id=served.resource_id, **fields
    )


def _error_span(
    gw: Gateway, ctx: AttemptContext, chat: bool, started: float, exc: GatewayError, served: ServedWeights
) -> Span:
    attributes = {"backend": gw.backend.kind, "error": exc.message[:500], "http_status": exc.status}
    attributes["weights"] = served.attributes()
    return _call_span(ctx, chat, started, served, attributes, status="error")
