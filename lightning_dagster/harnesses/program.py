"""What the example agents share to run as standalone Agent Lightning programs: the attempt's task from the
environment, a client for the attempt, the assistant turn a tool loop sends back, and the reward posted as
Agent Lightning's event. It needs only `openai` (and its `httpx`), like the agents themselves."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx
from openai import OpenAI

Solve = Callable[[dict[str, Any], OpenAI], float]


def read_task() -> dict[str, Any]:
    """The attempt's task: `AGL_TASK`, or the file `LD_TASK_FILE` names (a task too large for an environment
    variable, over 128 KiB, is only there)."""
    text = os.environ.get("AGL_TASK")
    if text is None:
        with open(os.environ["LD_TASK_FILE"], encoding="utf-8") as task_file:
            text = task_file.read()
    return json.loads(text)


def assistant_turn(message: Any) -> dict[str, Any]:
    """The assistant message of a chat completion with tool calls, as the next request must repeat it."""
    return {
        "role": "assistant",
        "content": message.content,
        "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}
            for call in message.tool_calls or []
        ],
    }  # fmt: skip


def post_reward(event_url: str, api_key: str, value: float) -> None:
    """Agent Lightning's event shape, so any AGL-compatible server accepts it."""
    response = httpx.post(
        event_url,
        json={"event_type": "reward", "data": {"value": value}},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30.0,
    )
    response.raise_for_status()


def run_task(solve: Solve, task: dict[str, Any], *, base_url: str, api_key: str, event_url: str) -> float:
    """Solve one task with a client for the attempt, post the reward, return it."""
    with OpenAI(base_url=base_url, api_key=api_key, max_retries=1, timeout=60.0) as client:
        reward = solve(task, client)
    post_reward(event_url, api_key, reward)
    return reward


def main(solve: Solve) -> int:
    """The program's body: the task, endpoint and keys from the Agent Lightning environment."""
    task = read_task()
    reward = run_task(
        solve,
        task,
        base_url=os.environ.get("AGL_OPENAI_BASE_URL") or os.environ["OPENAI_BASE_URL"],
        api_key=os.environ.get("AGL_KEY") or os.environ["OPENAI_API_KEY"],
        event_url=os.environ["AGL_EVENT_URL"],
    )
    print(json.dumps({"task_id": task.get("task_id"), "reward": reward}))
    return 0
