"""Request validation and OpenAI-shaped responses (JSON and SSE) built from one `Completion`.

Requests are validated strictly (422 naming the field); unknown fields are allowed. Responses carry vLLM's
extra fields `prompt_token_ids` and per-choice `token_ids`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from lightning_dagster.gateway.backends import CallSampling, Completion
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.tokenin import content_text
from lightning_dagster.store.connection import bad_json, suspect_json

_STRICT = ConfigDict(extra="allow", strict=True)


class Message(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def plain(self) -> dict[str, Any]:
        """The message as the template renders it (text content; the client's null fields dropped)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        out["content"] = content_text(self.content) if self.content is not None else None
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class _Sampled(BaseModel):
    model_config = _STRICT
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None
    n: int | None = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int | None) -> int | None:
        if n is not None and n != 1:
            raise ValueError("only n=1 is supported (send n requests for n samples)")
        return n

    def sampling(self, seed: int | None, logprobs: bool, max_tokens: int | None) -> CallSampling:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return CallSampling(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=max_tokens,
            stop=stop,
            seed=self.seed if self.seed is not None else seed,
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Sampled):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(_Sampled):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise GatewayError(400, "only one prompt per request is supported", param="prompt")
            p = p[0]
        if not p:
            raise GatewayError(400, "the prompt is empty", param="prompt")
        return p


# The error code of a reward value that is no finite float (the `BadReward` of a harness's returned value).
BAD_REWARD = "bad_reward"


class RewardRequest(BaseModel):
    """A reward: `value` (and `uncertainty`) a finite JSON number, never a string or boolean coerced into
    one; string lengths are the store's column limits, so both stores refuse the same input."""

    model_config = ConfigDict(extra="allow")
    value: float = Field(strict=True)
    judge: str = Field("harness", min_length=1, max_length=128)
    judge_version: str = Field("1", min_length=1, max_length=64)
    uncertainty: float | None = Field(None, strict=True)
    rollout_id: str | None = Field(None, max_length=64)
    attempt_id: str | None = Field(None, max_length=64)

    @field_validator("value", "uncertainty", mode="before")
    @classmethod
    def _fits_a_float(cls, value: Any) -> Any:
        # A JSON integer past a float's range (10**400) parses as a Python int; strict float validation
        # would call it "not a valid number". Named as what it is (BAD_REWARD), with the message saying why.
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                float(value)
            except OverflowError:
                raise PydanticCustomError(
                    BAD_REWARD,
                    "an integer too large for a float (beyond about 1.8e308); expected a finite number",
                ) from None
        return value

    @field_validator("value", "uncertainty")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise PydanticCustomError(BAD_REWARD, "must be a finite number")
        return value


class EventRequest(BaseModel):
    """Agent Lightning v1.0's `EventCreate`; `event_type` names the span (at most 256 characters)."""

    model_config = ConfigDict(extra="allow")
    event_type: str = Field(min_length=1, max_length=256)
    data: dict[str, Any] = Field(default_factory=dict)


def validate(model: type[BaseModel], raw: bytes) -> Any:
    """Parse and validate a JSON body; errors name the field (`messages.0.role: ...`)."""
    return check(model, parse(raw))


def parse_json(raw: bytes) -> Any:
    """Any JSON value without NaN, Infinity or NUL characters (JSON has no NaN, and PostgreSQL stores
    neither): any of them is a 422 naming its field, on every store alike."""
    # pydantic_core's Rust parser (cheaper than json.loads per call); it also rejects invalid UTF-8
    try:
        data = pydantic_core.from_json(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}") from exc
    if suspect_json(raw) and (found := bad_json(data)):
        raise GatewayError(422, found, param=found.split(":", 1)[0])
    return data


def parse(raw: bytes) -> dict:
    if not isinstance(data := parse_json(raw), dict):
        raise GatewayError(400, "the body must be a JSON object")
    return data


def check(model: type[BaseModel] | TypeAdapter, data: Any, where: str = "") -> Any:
    try:
        return model.validate_python(data) if isinstance(model, TypeAdapter) else model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = where + ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        code = BAD_REWARD if first["type"] == BAD_REWARD else None
        raise GatewayError(422, f"{field}: {first['msg']}{more}", param=field, code=code) from exc


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON (pydantic_core: cheaper than json.dumps for token id and logprob lists)."""
    return pydantic_core.to_json(obj)


def _usage(c: Completion) -> dict[str, int]:
    n_prompt, n_out = len(c.prompt_ids), len(c.response_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def _chat_logprobs(c: Completion) -> dict[str, Any]:
    texts = c.token_texts or [""] * len(c.response_ids)
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(texts, c.logprobs or [], strict=False)
        ]
    }


def _completion_logprobs(c: Completion) -> dict[str, Any]:
    texts = c.token_texts or [""] * len(c.response_ids)
    offsets, pos = [], 0
    for t in texts:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": texts, "token_logprobs": c.logprobs or [], "top_logprobs": None, "text_offset": offsets}


def assistant_message(c: Completion) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.content}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return message


def _response(c: Completion, prefix: str, kind: str, choice: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": c.model,
        "choices": [{"index": 0, **choice}],
        "usage": _usage(c),
        **extra,
    }


def chat_response(c: Completion, logprobs: bool) -> dict[str, Any]:
    choice = {
        "message": assistant_message(c),
        "logprobs": _chat_logprobs(c) if logprobs else None,
        "finish_reason": c.finish_reason,
        "token_ids": c.response_ids,
    }
    return _response(c, "chatcmpl", "chat.completion", choice, prompt_token_ids=c.prompt_ids)


def completion_response(c: Completion, logprobs: bool) -> dict[str, Any]:
    choice = {
        "text": c.content or "",
        "logprobs": _completion_logprobs(c) if logprobs else None,
        "finish_reason": c.finish_reason,
        "token_ids": c.response_ids,
        "prompt_token_ids": c.prompt_ids,
    }
    return _response(c, "cmpl", "text_completion", choice)


def sse(response: dict[str, Any], *, include_usage: bool) -> Iterator[bytes]:
    """A finished response replayed as SSE chunks (generation completes before the first chunk, so a
    streamed call records the very span the non-streamed call records)."""
    chat = response["object"] == "chat.completion"
    choice = response["choices"][0]
    head = {
        "id": response["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": response["created"],
        "model": response["model"],
    }

    def chunk(payload: dict[str, Any], **extra: Any) -> bytes:
        return b"data: " + dumps({**head, "choices": [{"index": 0, **payload}], **extra}) + b"\n\n"

    if chat:
        message = choice["message"]
        first = {"delta": {"role": "assistant", "content": message["content"] or ""}, "finish_reason": None}
        yield chunk(
            {**first, "logprobs": choice["logprobs"], "token_ids": choice["token_ids"]},
            prompt_token_ids=response["prompt_token_ids"],
        )
        calls = message.get("tool_calls") or []
        if calls:
            yield chunk({"delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}})
        yield chunk({"delta": {}, "finish_reason": choice["finish_reason"]})
    else:
        yield chunk({**choice, "finish_reason": None})
        yield chunk({"text": "", "finish_reason": choice["finish_reason"]})
    if include_usage:
        yield b"data: " + dumps({**head, "choices": [], "usage": response["usage"]}) + b"\n\n"
    yield b"data: [DONE]\n\n"


class KeyRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    rollout_id: str = Field(min_length=1)
    attempt_id: str = Field(min_length=1)


class WeightsRequest(BaseModel):
    """`POST /admin/weights`: a safetensors file on the gateway's disk, and the resource id spans record."""

    model_config = ConfigDict(strict=True)
    path: str = Field(min_length=1)
    resource_id: str | None = Field(None, max_length=64)
