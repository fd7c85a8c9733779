"""A scripted OpenAI-compatible endpoint for testing a harness's own loop (tool execution, message threading,
reward posting) independently of what a tiny model happens to sample. The real-gateway path is tested in
tests/runner."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ScriptedLLM:
    """Answers the n-th chat completion with the n-th scripted assistant message; records every request."""

    def __init__(self, replies: list[dict[str, Any]]):
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []  # (Authorization header, body)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/events"):
                    outer.events.append((self.headers.get("Authorization", ""), body))
                    self._send({"ok": True})
                    return
                outer.requests.append(body)
                message = outer.replies[len(outer.requests) - 1]
                finish = "tool_calls" if message.get("tool_calls") else "stop"
                self._send(
                    {
                        "id": f"chatcmpl-{len(outer.requests)}",
                        "object": "chat.completion",
                        "created": 0,
                        "model": "policy",
                        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    }
                )

            def _send(self, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> ScriptedLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def tool_call(name: str, arguments: dict[str, Any], call_id: str = "call_0") -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        ],
    }


def say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}
