"""A stub of vLLM's OpenAI server for tests and benchmarks: deterministic, no model, vLLM-shaped JSON.

One token per character (id = code point), so a conversation's prompt ids extend the previous call's
prompt + response exactly, as a real prefix-preserving template would. Each reply is `max_tokens` (default
`reply_tokens`) characters long with float32-exact logprobs. Run `python -m tests.support.stub_upstream --port P`
from the repository root.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def render(messages: list[dict]) -> str:
    return "".join(f"<{m.get('role')}>{m.get('content') or ''}" for m in messages) + "<assistant>"


def reply(prompt: str, n: int) -> str:
    seed = hashlib.sha256(prompt.encode()).hexdigest()
    return (seed * (n // len(seed) + 1))[:n]


def _logprobs(text: str) -> list[float]:
    return [-((ord(c) % 7) / 8) for c in text]  # multiples of 1/8: exact in float32


def create_stub_app(reply_tokens: int = 50) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
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
        body = json.loads(await request.body())
        prompt = body["prompt"]
        prompt_ids = prompt if isinstance(prompt, list) else _ids(prompt)
        text = reply(str(prompt), int(body.get("max_tokens") or reply_tokens))
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
            "token_ids": _ids(text),
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
