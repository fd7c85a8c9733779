"""What the example agents share to run as standalone Agent Lightning programs (task, client, tool loop,
reward event); it needs only `openai` (and its `httpx`), like the agents themselves."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx
from openai import OpenAI

Solve = Callable[[dict[str, Any], OpenAI], float]


def read_task() -> dict[str, Any]:
    """The attempt's task: `AGL_TASK`, or the file `LD_TASK_FILE` names (a task over 128 KiB)."""
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


def tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    """A function tool in OpenAI's shape; every parameter (`name="JSON type"`) is required."""
    schema = {key: {"type": kind} for key, kind in properties.items()}
    parameters = {"type": "object", "properties": schema, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def tool_result(call: Callable[[dict[str, Any]], str], arguments: str, refused: type[Exception]) -> str:
    """A tool call's message: `call(its arguments)`, or an `error: ...` for the model."""
    try:
        args = json.loads(arguments or "{}")
        if not isinstance(args, dict):
            raise refused("arguments must be a JSON object")
        return call(args)
    except json.JSONDecodeError:
        return "error: arguments are not valid JSON"
    except refused as exc:
        return f"error: {exc}"


def tool_loop(
    client: OpenAI,
    system: str,
    question: str,
    tools: list[dict[str, Any]],
    run_tool: Callable[[str, str], str],
    *,
    max_turns: int,
    max_tokens: int,
) -> str | None:
    """The tool loop: the model's first reply without a tool call, or None after `max_turns` calls."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
    ]
    for _ in range(max_turns):
        response = client.chat.completions.create(
            model="policy",
            messages=messages,
            tools=tools,
            temperature=1.0,  # a rollout's own sampling, when it has one, is applied by the gateway
            max_tokens=max_tokens,
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content
        messages.append(assistant_turn(message))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None


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
