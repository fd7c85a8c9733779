"""A starter agent: asks the model one arithmetic question and reports whether the answer is right.

It runs as a plain program and needs only `openai`: its task is the JSON in `LD_TASK` (or, over 128 KiB, in
the file `LD_TASK_FILE` names), the model is the
OpenAI-compatible server at `OPENAI_BASE_URL` (key `OPENAI_API_KEY`), and it posts one reward to
`AGL_EVENT_URL` with the bearer token `AGL_KEY`. Replace `solve` with your own agent; keep posting a reward.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from typing import Any

from openai import OpenAI

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def solve(client: OpenAI, task: dict[str, Any]) -> float:
    """One model call; reward 1.0 when the first number in the reply is the task's answer."""
    response = client.chat.completions.create(
        model="policy",
        messages=[
            {"role": "system", "content": "Reply with the number only."},
            {"role": "user", "content": task["question"]},
        ],
        max_tokens=16,
    )
    match = NUMBER.search(response.choices[0].message.content or "")
    return 1.0 if match and float(match.group()) == float(task["answer"]) else 0.0


def post_reward(value: float) -> None:
    """Agent Lightning's event shape, so any AGL-compatible server accepts it."""
    request = urllib.request.Request(
        os.environ["AGL_EVENT_URL"],
        data=json.dumps({"event_type": "reward", "data": {"value": value}}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {os.environ['AGL_KEY']}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


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
    client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"], api_key=os.environ["OPENAI_API_KEY"])
    reward = solve(client, task)
    post_reward(reward)
    print(json.dumps({"task_id": task["task_id"], "reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
