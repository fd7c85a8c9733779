"""Drives a server with Agent Lightning 1.0.2's own code (run in its Python 3.12 venv; prints one JSON line).

    python driver.py submit URL    create rollouts with its client, run them with its local controller (the
                                   agent `calc_agent:CalcAgent`), then pause the proxy as its trainer does
    python driver.py collect URL   resume as its trainer does, read the triplet events and the terminal page

The server key comes in `AGL_SERVER_KEY`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

from agentlightning.client import AgentLightningAsyncClient, AgentLightningSyncClient
from agentlightning.controller.local_reconciler import LocalReconciler
from agentlightning.schemas import TERMINAL_STATES, Event, Rollout, RolloutCreate
from omegaconf import OmegaConf

QUESTIONS = ["2+2", "17*3", "100-1"]
IDS = [f"agl-{i}" for i in range(len(QUESTIONS))]


def rollouts_of(client: AgentLightningSyncClient) -> dict[str, Rollout]:
    out = {}
    for rid in IDS:
        r = client.get(f"/api/rollouts/{rid}")
        r.raise_for_status()
        out[rid] = Rollout.model_validate(r.json()["rollout"])
    return out


async def run_controller(url: str, key: str, client: AgentLightningSyncClient) -> None:
    config = OmegaConf.create(
        {
            "runner_type": "local",
            "agl_server": {"url": url, "agent_url": None, "key": key},
            "local_runner": {"maximum_size": 3, "poll_interval": 0.2},
        }
    )
    async with AgentLightningAsyncClient(base_url=url, key=key) as api:
        reconciler = LocalReconciler(api=api, config=config)
        task = asyncio.create_task(reconciler.run())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            states = await asyncio.to_thread(lambda: [r.status.state for r in rollouts_of(client).values()])
            if all(s in TERMINAL_STATES for s in states):
                break
            await asyncio.sleep(0.2)
        reconciler.stop()
        await task


def submit(url: str, key: str) -> dict:
    client = AgentLightningSyncClient(base_url=url, key=key, timeout=60, max_retries=2)
    config = {
        "timeout_seconds": 60,
        "local": {"agent_class": "calc_agent:CalcAgent", "env_map": {"QUESTION": "input.question"}},
    }
    creates = [
        RolloutCreate(input={"question": q, "data_id": f"d{i}"}, config=config, metadata={}, rollout_id=rid)
        for i, (q, rid) in enumerate(zip(QUESTIONS, IDS, strict=True))
    ]
    payload = [c.model_dump(mode="json", exclude_none=True) for c in creates]
    created = [
        Rollout.model_validate(x) for x in client.post_with_retry("/api/rollouts", json=payload).json()
    ]
    asyncio.run(run_controller(url, key, client))
    # the trainer's pause-and-drain around a weight update
    paused = client.post_with_retry("/proxy/pause", json={"reason": "weights"}).json()
    while client.get("/proxy/state").json()["inflight"] > 0:
        time.sleep(0.1)
    proxy = f"{url}/proxy/rollout/{IDS[0]}/attempt/0/mode/train/openai/v1/chat/completions"
    refused = client.post(proxy, json={"messages": [{"role": "user", "content": "x"}]})
    return {
        "created": [r.status.state.value for r in created],
        "states": {rid: r.status.state.value for rid, r in rollouts_of(client).items()},
        "paused": paused,
        "paused_call": refused.status_code,
        "retry_after": refused.headers.get("retry-after"),
    }


def collect(url: str, key: str) -> dict:
    client = AgentLightningSyncClient(base_url=url, key=key, timeout=60, max_retries=2)
    state_before = client.get("/proxy/state").json()
    client.post_with_retry("/proxy/resume")
    rollouts = rollouts_of(client)
    triplets, rewards = {}, {}
    for rid in IDS:
        r = client.get(
            f"/api/rollouts/{rid}/events", params={"format": "triplet", "include_routed_experts": False}
        )
        r.raise_for_status()
        events = [Event.model_validate(e) for e in r.json()]
        triplets[rid] = [
            [e.data["prompt_token_ids"], e.data["response_token_ids"], e.data["response_log_probs"]]
            for e in events
            if e.event_type == "model_request"
        ]
        rewards[rid] = [e.data["value"] for e in events if e.event_type == "reward"]
    terminal = client.get("/api/rollouts/terminal", params={"after": 0, "limit": 10}).json()
    return {
        "state_before_resume": state_before,
        "state_after_resume": client.get("/proxy/state").json(),
        "states": {rid: r.status.state.value for rid, r in rollouts.items()},
        "triplets": triplets,
        "rewards": rewards,
        "terminal": terminal,
    }


if __name__ == "__main__":
    step, url = sys.argv[1:3]
    key = os.environ["AGL_SERVER_KEY"]
    print(json.dumps((submit if step == "submit" else collect)(url, key)))
