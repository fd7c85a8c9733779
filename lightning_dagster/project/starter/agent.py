"""A starter agent with a calculator: asks the model for the sum or difference a word problem needs (`12+7`),
computes it, and reports whether that is the answer.

It runs as a plain program: its task is the JSON in `LD_TASK` (or, over 128 KiB, in the file `LD_TASK_FILE`
names), the model is the OpenAI-compatible server at `OPENAI_BASE_URL` (key `OPENAI_API_KEY`), and it posts
one reward to `AGL_EVENT_URL` with the bearer token `AGL_KEY`. Replace `solve` with your own agent; keep
posting a reward. An agent using the `openai` client works the same way, through the same variables.

It needs only the standard library: every attempt is a new process, and `import openai` alone costs about a
second of CPU per process (benchmarks/README.md, runner), ten times what this agent costs in all.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from typing import Any

EXPRESSION = re.compile(r"\s*(\d{1,6})\s*([+-])\s*(\d{1,6})\s*")


def calculate(reply: str) -> int | None:
    """The calculator: `a+b` or `a-b` computed; None for anything else."""
    match = EXPRESSION.fullmatch(reply)
    if match is None:
        return None
    a, op, b = match.groups()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def post(url: str, body: dict[str, Any], key: str) -> bytes:
    """POST `body` as JSON with a bearer `key`; the reply's body."""
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def solve(task: dict[str, Any]) -> float:
    """One chat completion; reward 1.0 when the expression it replies computes the task's answer."""
    reply = json.loads(
        post(
            os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
            {
                "model": "policy",
                "messages": [
                    {"role": "system", "content": "Reply with the sum or difference to compute, like 12+7."},
                    {"role": "user", "content": task["question"]},
                ],
                "max_tokens": 16,
            },
            os.environ["OPENAI_API_KEY"],
        )
    )
    value = calculate(reply["choices"][0]["message"]["content"] or "")
    return 1.0 if value is not None and value == int(task["answer"]) else 0.0


def post_reward(value: float) -> None:
    """Agent Lightning's event shape, so any AGL-compatible server accepts it."""
    post(
        os.environ["AGL_EVENT_URL"], {"event_type": "reward", "data": {"value": value}}, os.environ["AGL_KEY"]
    )


def read_task() -> dict[str, Any]:
    """This attempt's task: `LD_TASK`, or the file `LD_TASK_FILE` names (a task too large for an environment
    variable, over 128 KiB, is only there)."""
    text = os.environ.get("LD_TASK")
    if text is None:
        with open(os.environ["LD_TASK_FILE"], encoding="utf-8") as task_file:
            text = task_file.read()
    return json.loads(text)


def main() -> int:
    task = read_task()
    reward = solve(task)
    post_reward(reward)
    print(json.dumps({"task_id": task["task_id"], "reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
