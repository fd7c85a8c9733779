"""Ideal calc episodes for the warm start: what `agent.run_episode` sends and gets on a perfect run."""

from __future__ import annotations

import json
from typing import Any

from lightning_dagster.harnesses.calc.agent import SYSTEM_PROMPT, TOOLS, calculate, format_number


def demo_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """system, user question -> assistant calculator call -> tool result -> assistant `ANSWER: x`."""
    result = calculate(task["expression"])  # the real tool, so the demo's tool message is what it returns
    arguments = json.dumps({"expression": task["expression"]})
    call = {"id": "call_0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": f"ANSWER: {format_number(task['answer'])}"},
    ]


def demo_tools() -> list[dict[str, Any]]:
    """The tool list the agent sends with every call (render the demo with it)."""
    return TOOLS
