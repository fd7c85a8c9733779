"""What a judge reads: an attempt's transcript from its LLM spans, a dict per successful call in order
(`name`, `prompt_token_ids`, `response_token_ids`, `finish_reason`, and `response_text` with a codec)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_dagster.store import Store
from lightning_dagster.types import SpanKind

Decode = Callable[[list[int]], str]


def transcript(store: Store, attempt_id: str, decode: Decode | None = None) -> list[dict[str, Any]]:
    calls = []
    for span in store.list_spans(attempt_id=attempt_id, kind=SpanKind.llm):
        if span.status != "ok" or span.response_token_ids is None:
            continue
        call: dict[str, Any] = {
            "name": span.name,
            "prompt_token_ids": list(span.prompt_token_ids or []),
            "response_token_ids": list(span.response_token_ids),
            "finish_reason": span.finish_reason,
        }
        if decode is not None:
            call["response_text"] = decode(call["response_token_ids"])
        calls.append(call)
    return calls
