"""Token-in: re-use the exact token ids an attempt already produced when a harness re-sends its history.

Invariant: if call k+1's messages continue call k's plus its reply, call k+1's prompt ids are `prompt_k +
response_k + closing + delta` (`closing`: the template's end-of-turn not already sampled; `delta`: what
rendering the whole conversation adds after call k's). Sampled ids are never re-encoded, so re-tokenisation
drift cannot enter the prompt. The template being prefix-preserving is checked on every call: when it is
not, the prompt is rendered afresh (`TokenInStats.fallbacks`), never spliced from ids it disagrees with.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# render(messages, tools, add_generation_prompt) -> token ids
Render = Callable[[list[dict], list[dict] | None, bool], list[int]]


def content_text(content: Any) -> str:
    """OpenAI content is a string, None, or a list of parts; only text parts reach a text-only template."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _arguments(arguments: Any) -> Any:
    # A harness may re-serialise arguments (spacing, key order); compare their meaning.
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def normalize_message(message: dict) -> dict:
    """The part of a message that decides how it renders (the openai client adds None-valued fields)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": content_text(message.get("content"))}
    if message.get("name"):
        out["name"] = message["name"]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "name": (c.get("function") or {}).get("name"),
                "arguments": _arguments((c.get("function") or {}).get("arguments")),
            }
            for c in calls
        ]
    return out


def normalize_messages(messages: Sequence[dict]) -> list[dict]:
    return [normalize_message(m) for m in messages]


@dataclass
class LastCall:
    """What an attempt's previous call saw and produced; kept compactly (one int32 array)."""

    messages: list[dict]  # normalised: the request's messages plus the assistant message returned
    raw_messages: list[dict]  # the same, as rendered (for re-rendering the history)
    tools: list[dict] | None
    ids: array  # prompt ids + response ids

    @classmethod
    def of(
        cls,
        messages: list[dict],
        assistant: dict,
        tools: list[dict] | None,
        prompt_ids: Sequence[int],
        response_ids: Sequence[int],
    ) -> LastCall:
        raw = [*messages, assistant]
        return cls(normalize_messages(raw), raw, tools, array("i", [*prompt_ids, *response_ids]))


@dataclass
class TokenInStats:
    """How many follow-up calls reused the previous call's exact ids (per attempt, and per gateway)."""

    calls: int = 0
    continuations: int = 0  # calls that had a previous LLM call in the same attempt
    token_in: int = 0  # ... whose prompt extended that call's prompt + response exactly
    # ... whose messages continued that call but whose prompt could not be built on its ids (the template
    # is not prefix-preserving): rendered afresh instead
    fallbacks: int = 0

    def count(self, had_previous: bool, extended: bool, fallback: bool = False) -> None:
        self.calls += 1
        self.continuations += had_previous
        self.token_in += extended
        self.fallbacks += fallback

    def as_dict(self) -> dict[str, Any]:
        share = self.token_in / self.continuations if self.continuations else None
        return {**self.__dict__, "token_in_share": share}


def extends(prompt_ids: Sequence[int], previous: array | None) -> bool:
    """Whether `prompt_ids` starts with the previous call's prompt + response, token for token."""
    if previous is None or len(prompt_ids) < len(previous):
        return False
    return array("i", prompt_ids[: len(previous)]) == previous


def closing_tokens(render: Render) -> list[int] | None:
    """The tokens the template writes after an assistant message's content; None: not prefix-preserving."""
    probe = [{"role": "user", "content": "x"}]
    head = render(probe, None, True)
    turn = render([*probe, {"role": "assistant", "content": ""}], None, False)
    if turn[: len(head)] != head:
        return None
    return turn[len(head) :]


def continues(previous: LastCall | None, messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether `messages` are the previous call's messages and reply, then more (with the same tools)."""
    if previous is None or tools != previous.tools:
        return False
    n = len(previous.messages)
    return len(messages) > n and normalize_messages(messages[:n]) == previous.messages


def continue_prompt(
    render: Render,
    closing: list[int] | None,
    previous: LastCall | None,
    messages: list[dict],
    tools: list[dict] | None,
) -> list[int] | None:
    """Prompt ids built on the previous call's exact ids, or None (the caller renders afresh)."""
    if closing is None or previous is None or not continues(previous, messages, tools):
        return None
    history = render(previous.raw_messages, tools, False)
    full = render(messages, tools, True)
    if full[: len(history)] != history:
        return None  # the template rewrote earlier turns: no exact continuation exists
    if closing and history[-len(closing) :] != closing:
        return None  # this assistant turn is closed otherwise than the probe's: the glue would be wrong
    ids = list(previous.ids)
    # The model may have sampled the first end-of-turn token itself; append only what it did not.
    glue = closing[1:] if closing and ids and ids[-1] == closing[0] else closing
    return ids + glue + full[len(history) :]
