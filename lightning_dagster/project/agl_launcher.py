"""Agent Lightning's side of a harness, and `python -m lightning_dagster.project.agl_launcher ROOT
module:Class`: an Agent Lightning v1.0-style class's `run()` called (or awaited), a number it returns
posted. The standard library only, so each attempt's process starts fast."""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import numbers
import os
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_dagster.project.references import resolve_agent_class

POST_TIMEOUT_S = 30.0
AGL_LAUNCHER_USAGE = "usage: python -m lightning_dagster.project.agl_launcher ROOT module:Class"


class BadReward(TypeError):
    """A harness or judge returned something that is not a reward (a finite number, or None)."""


def reward_value(value: Any, source: str) -> float | None:
    """`value` as a reward: None (posted by the harness), a finite float, or BadReward (10**400 too)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadReward(
            f"{source} returned {type(value).__name__} {value!r}; expected a finite number or None"
        )
    try:
        reward = float(value)
    except OverflowError:  # its text may be thousands of digits (past int's str limit): not shown
        raise BadReward(
            f"{source} returned an {type(value).__name__} too large for a float (beyond about 1.8e308); "
            "expected a finite number or None"
        ) from None
    if not math.isfinite(reward):
        raise BadReward(
            f"{source} returned {type(value).__name__} {value!r}; expected a finite number or None"
        )
    return reward


def post_reward(event_url: str, key: str, value: float, *, judge: str | None = None) -> None:
    """POST Agent Lightning's reward event to `event_url` with the attempt key; `judge`: who scored it."""
    data: dict[str, Any] = {"value": value}
    if judge is not None:
        data["judge"] = judge
    request = urllib.request.Request(
        event_url,
        data=json.dumps({"event_type": "reward", "data": data}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=POST_TIMEOUT_S) as response:
        response.read()


def read_task(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A harness's task: the JSON in `AGL_TASK` (or `LD_TASK`), else in `LD_TASK_FILE` (over 128 KiB)."""
    env = os.environ if environ is None else environ
    text = env.get("AGL_TASK", env.get("LD_TASK"))
    if text is None:
        if "LD_TASK_FILE" not in env:
            raise KeyError("no task: none of AGL_TASK, LD_TASK and LD_TASK_FILE is set")
        text = Path(env["LD_TASK_FILE"]).read_text(encoding="utf-8")
    return json.loads(text)


def run_agent(ref: str, root: Path) -> float | None:
    """Instantiate the class `ref` names (importing from `root` first), run it and post what it returns."""
    try:
        agent_class = resolve_agent_class(ref, root)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    result = agent_class().run()
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))
    value = reward_value(result, f"{ref}.run()")
    if value is not None:
        post_reward(os.environ["AGL_EVENT_URL"], os.environ["AGL_KEY"], value)
    return value


async def _wait(awaitable: Any) -> Any:
    return await awaitable


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(AGL_LAUNCHER_USAGE, file=sys.stderr)
        return 2
    run_agent(args[1], Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
