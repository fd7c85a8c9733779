"""An agent written for Agent Lightning 1.0.2's local controller: a class whose `run()` reads the AGL_*
variables and `QUESTION` (the controller's env_map), talks to the proxy twice and posts its reward event.
Standard library and httpx only (what the Agent Lightning environment has)."""

from __future__ import annotations

import os

import httpx


class CalcAgent:
    def run(self) -> None:
        base, key = os.environ["AGL_OPENAI_BASE_URL"], os.environ["AGL_KEY"]
        headers = {"Authorization": f"Bearer {key}"}
        messages = [{"role": "user", "content": os.environ["QUESTION"]}]
        for turn in range(2):
            r = httpx.post(
                f"{base}/chat/completions",
                json={"model": "agent-model", "messages": messages, "temperature": 0.0},
                headers=headers,
                timeout=60,
            )
            r.raise_for_status()
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"turn {turn}"}]
            messages[-2] = {"role": "assistant", "content": messages[-2]["content"]}
        reward = {
            "event_type": "reward",
            "data": {"value": float(len(os.environ["QUESTION"])), "source": "agent"},
        }
        httpx.post(os.environ["AGL_EVENT_URL"], json=reward, headers=headers, timeout=60).raise_for_status()
