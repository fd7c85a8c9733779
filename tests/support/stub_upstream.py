"""A stub of vLLM's OpenAI server for tests and benchmarks: deterministic, no model, vLLM-shaped JSON.

One token per character (id = code point), so a conversation's prompt ids extend the previous call's
prompt + response exactly, as a real prefix-preserving template would. Each reply is `max_tokens` (default
`reply_tokens`) characters long with float32-exact logprobs. Run `python -m tests.support.stub_upstream --port P`
from the repository root.

`check_token_ids=True` makes a stub of token-in upstream: its completions replies spell each `a` with a
non-canonical token (`ALT + ord("a")`, so re-encoding the decoded reply gives other ids), a last user turn
`TOOL_PROMPT` is answered with a tool call, and every token-id prompt must equal the exact ids of the longest
conversation it served before that the prompt continues, plus the canonical ids of the new text; any other
prompt is refused with a 400 naming both and kept in `app.state.mismatches`. `app.state.fail_status`, when
set, answers every call with that status; `app.state.calls` counts calls per route.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import Counter

from fastapi import FastAPI, Request
from fastapi.responses import Response

ALT = 0x110000  # above every code point: an alternative spelling of a character
TOOL_PROMPT = "use the tool"
TOOL_REPLY = '<tool_call>{"name": "now", "arguments": {"zone": "utc"}}</tool_call>'


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i - ALT if i >= ALT else i) for i in ids)


def _spelled(text: str) -> list[int]:
    return [ALT + ord(c) if c == "a" else ord(c) for c in text]


class StubCodec:
    """The stub's chat template and tool-call syntax, as a gateway codec (`UpstreamBackend(codec=)`)."""

    def render(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt=True):
        text = render(messages)
        return _ids(text if add_generation_prompt else text[: -len("<assistant>")])

    def parse_assistant(self, text: str):
        from lightning_dagster.engine.chat import parse_assistant

        return parse_assistant(text)


def render(messages: list[dict]) -> str:
    return "".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in messages) + "<assistant>"


def reply(prompt: str, n: int) -> str:
    seed = hashlib.sha256(prompt.encode()).hexdigest()
    return (seed * (n // len(seed) + 1))[:n]


def _logprobs(text: str) -> list[float]:
    return [-((ord(c) % 7) / 8) for c in text]  # multiples of 1/8: exact in float32


def create_stub_app(reply_tokens: int = 50, *, check_token_ids: bool = False) -> FastAPI:
    app = FastAPI()
    app.state.fail_status = None
    app.state.calls = Counter()
    app.state.mismatches = []
    served: dict[str, list[int]] = {}  # decoded prompt + reply -> the exact ids (check_token_ids)

    def refuse(status: int, message: str) -> Response:
        return Response(json.dumps({"error": {"message": message}}), status_code=status)

    def check(prompt_ids: list[int]) -> str | None:
        text = decode(prompt_ids)
        base = max((t for t in served if text.startswith(t)), key=len, default="")
        expected = (served[base] if base else []) + _ids(text[len(base) :])
        if prompt_ids == expected:
            return None
        app.state.mismatches.append((prompt_ids, expected))
        return f"token-id prompt mismatch: expected {expected}, got {prompt_ids}"

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        app.state.calls["chat"] += 1
        if app.state.fail_status:
            return refuse(app.state.fail_status, "stub told to fail")
        body = json.loads(await request.body())
        prompt = render(body["messages"])
        text = reply(prompt, int(body.get("max_tokens") or reply_tokens))
        lps = _logprobs(text)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": {
                "content": [
                    {"token": c, "logprob": lp, "bytes": list(c.encode()), "top_logprobs": []}
                    for c, lp in zip(text, lps, strict=True)
                ]
            }
            if body.get("logprobs")
            else None,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": _ids(text) if body.get("return_token_ids") else None,
        }
        out = {
            "id": "chatcmpl-stub",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "stub",
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(text),
                "total_tokens": len(prompt) + len(text),
            },
            "prompt_logprobs": None,
            "prompt_token_ids": _ids(prompt) if body.get("return_token_ids") else None,
        }
        return Response(json.dumps(out), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        app.state.calls["completions"] += 1
        if app.state.fail_status:
            return refuse(app.state.fail_status, "stub told to fail")
        body = json.loads(await request.body())
        prompt = body["prompt"]
        prompt_ids = prompt if isinstance(prompt, list) else _ids(prompt)
        n = int(body.get("max_tokens") or reply_tokens)
        if check_token_ids:
            if not isinstance(prompt, list) or (problem := check(prompt)) is not None:
                return refuse(400, problem or "this stub takes token-id prompts only")
            text = TOOL_REPLY if decode(prompt).endswith(f"<user>{TOOL_PROMPT}<assistant>") else None
            text = text or reply(decode(prompt), n)
            token_ids = _spelled(text)
            served[decode(prompt) + text] = prompt_ids + token_ids
        else:
            text = reply(str(prompt), n)
            token_ids = _ids(text)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": {
                "tokens": list(text),
                "token_logprobs": _logprobs(text),
                "top_logprobs": None,
                "text_offset": list(range(len(text))),
            }
            if body.get("logprobs")
            else None,
            "finish_reason": "length",
            "token_ids": token_ids,
            "prompt_token_ids": prompt_ids,
        }
        usage = {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(text),
            "total_tokens": len(prompt_ids) + len(text),
        }
        out = {
            "id": "cmpl-stub",
            "object": "text_completion",
            "created": int(time.time()),
            "model": "stub",
            "choices": [choice],
            "usage": usage,
        }
        return Response(json.dumps(out), media_type="application/json")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "stub", "object": "model"}]}

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reply-tokens", type=int, default=50)
    args = parser.parse_args()
    uvicorn.run(
        create_stub_app(args.reply_tokens),
        host=args.host,
        port=args.port,
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
