"""Runner throughput, subprocess vs in-process, side by side through one embedded gateway.

Two harnesses: `reward-only` (posts a reward and exits: the runner's own per-attempt cost, claim -> start ->
harness -> reward check -> ending) and the real `calc` agent (model calls included). Each is run in both
modes on the same tasks; rollouts/s, CPU seconds per rollout (this process + children) and the ratios print.

    .venv/bin/python benchmarks/runner_modes.py [--n 32] [--parallel 8] [--model DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from lightning_dagster.engine import build_base_model
from lightning_dagster.gateway import gateway_options
from lightning_dagster.gateway.local import LocalGateway
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store

POST_REWARD = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""


def post_reward(task: dict, *, base_url: str, api_key: str, event_url: str) -> float:
    body = json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    urllib.request.urlopen(
        urllib.request.Request(event_url, data=body, headers=headers, method="POST")
    ).read()
    return 1.0


def measure(store, gateway, spec, mode: str, n: int, parallel: int, seed: int, workdir: Path) -> dict:
    ids = [
        r.rollout_id
        for r in enqueue_tasks(
            store, spec, example_tasks(spec.name).draw("train", n, seed), kind="train", seed=seed
        )
    ]
    runner = Runner(
        store,
        gateway.url,
        secret=gateway.secret,
        harness=spec,
        parallel=parallel,
        policy=RetryPolicy(max_attempts=1, timeout_s=300),
        mode=mode,
        workdir=workdir,
    )
    cpu0, wall0 = os.times(), time.perf_counter()
    summary = runner.run(ids)
    cpu1, wall = os.times(), time.perf_counter() - wall0
    cpu = sum(cpu1[:4]) - sum(cpu0[:4])  # user+sys of this process and its finished children
    assert summary.attempts_by_ending == {"succeeded": n}, summary.attempts_by_ending
    return {"rollouts_per_s": n / wall, "cpu_ms_per_rollout": 1000 * cpu / n, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ld-bench-runner-") as tmp:
        tmp = Path(tmp)
        model = args.model or build_base_model(tmp / "model", corpus=training_corpus())
        store = Store(f"sqlite:///{tmp / 'store.db'}")
        calc = example_harness("calc")
        harnesses = {
            "reward-only": {
                "subprocess": dataclasses.replace(calc, argv=(sys.executable, "-c", POST_REWARD)),
                "inprocess": dataclasses.replace(calc, run_task=post_reward),
            },
            "calc": {"subprocess": calc, "inprocess": calc},
        }
        print(f"n={args.n} parallel={args.parallel} load={os.getloadavg()[0]:.1f}")
        # the engine inside the gateway: this process's CPU is the runner's and the gateway's
        with LocalGateway(store, model, gateway_options(ServingSettings(engine_process=False))) as gateway:
            measure(store, gateway, harnesses["reward-only"]["inprocess"], "inprocess", 4, 2, 99, tmp / "w")
            for name, by_mode in harnesses.items():
                row = {
                    mode: measure(store, gateway, spec, mode, args.n, args.parallel, 1, tmp / "w")
                    for mode, spec in by_mode.items()
                }
                sub, inp = row["subprocess"], row["inprocess"]
                for mode, r in row.items():
                    print(
                        f"{name:12s} {mode:10s} {r['rollouts_per_s']:7.2f} rollouts/s "
                        f"{r['cpu_ms_per_rollout']:7.1f} ms CPU/rollout  ({r['wall_s']:.1f}s)"
                    )
                print(
                    f"{name:12s} in-process/subprocess: {inp['rollouts_per_s'] / sub['rollouts_per_s']:.2f}x "
                    f"rollouts/s, {sub['cpu_ms_per_rollout'] / inp['cpu_ms_per_rollout']:.2f}x less CPU"
                )
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
