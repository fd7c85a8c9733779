"""Rollouts/s of a fleet on one PostgreSQL store: 1, 2 and 4 `lightning-dagster runner` processes against
1 or 2 gateway replicas (runners split across them), plus PostgreSQL's own enqueue and claim rate.

The harness is the trivial one of tests/fleet (logs, sleeps `--sleep`, returns reward 1: one reward post
per rollout), so the figures measure the queue, the runner and the gateway's reward path, not a model.
Run: `PYTHONPATH=. .venv/bin/python benchmarks/fleet.py --n 200`; results go to benchmarks/README.md."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import tempfile
import time
from pathlib import Path

from lightning_dagster.engine import build_base_model
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.store import Store
from lightning_dagster.types import Rollout, RolloutKind, RolloutStatus
from tests.fleet.conftest import SECRET, Gateway, child_env, cli, make_project
from tests.support.postgres import PostgresServer
from tests.support.secrets import secret_file


def store_rates(url: str, n: int) -> dict[str, float]:
    """Enqueue n rollouts in batches of 100, then claim them one by one from one connection."""
    store = Store(url)
    rows = [Rollout(kind=RolloutKind.train, task_id=f"t{i}", task={}, harness="bench") for i in range(n)]
    t0 = time.perf_counter()
    for i in range(0, n, 100):
        store.enqueue_rollouts(rows[i : i + 100])
    enqueue = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    while store.claim_rollout("bench", harness="bench") is not None:
        pass
    claim = n / (time.perf_counter() - t0)
    store.close()
    return {"enqueue_per_s": round(enqueue), "claim_per_s": round(claim)}


def fleet_rate(url: str, gateways: list[Gateway], runners: int, n: int, args, tmp: Path) -> float:
    project, log = make_project(tmp / "project", n), tmp / "runs.log"
    run_id = f"b{runners}x{len(gateways)}-{time.time_ns()}"
    env = child_env(project, log, FLEET_SLEEP=str(args.sleep))
    enqueue = cli("rollouts", "enqueue", "--project", str(project), "--n", str(n), "--run-id", run_id)
    subprocess.run([*enqueue, "--store-url", url], env=env, check=True, capture_output=True)
    store = Store(url)
    t0 = time.perf_counter()
    procs = [
        subprocess.Popen(
            cli(
                "runner",
                "--project",
                str(project),
                "--store-url",
                url,
                "--runner-mode",
                "inprocess",
                "--until-idle",
                "--parallel",
                str(args.parallel),
                "--gateway",
                gw.url,
                "--secret-file",
                secret_file(tmp, SECRET),
            ),
            env=env,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        for gw, _ in zip(itertools.cycle(gateways), range(runners), strict=False)
    ]
    for proc in procs:
        proc.wait()
    wall = time.perf_counter() - t0
    group_ids = [f"{run_id}-g{i}" for i in range(n)]
    done = len(store.query_rollouts(group_ids=group_ids, status=RolloutStatus.succeeded))
    store.close()
    assert done == n, f"{done} of {n} succeeded"
    return n / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=200, help="rollouts per configuration")
    parser.add_argument("--parallel", type=int, default=4, help="worker threads per runner process")
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds the harness sleeps")
    args = parser.parse_args()
    pg = PostgresServer().start()
    tmp = Path(tempfile.mkdtemp(prefix="ld-fleet-"))
    model_dir = build_base_model(tmp / "model", corpus=training_corpus())
    results: dict = {"store": store_rates(pg.url(pg.create_database()), 2000)}
    try:
        for replicas in (1, 2):
            url = pg.url(pg.create_database())
            gateways = [Gateway(tmp, url, model_dir) for _ in range(replicas)]
            try:
                for runners in (1, 2, 4):
                    sub = tmp / f"r{runners}g{replicas}"
                    sub.mkdir()
                    rate = fleet_rate(url, gateways, runners, args.n, args, sub)
                    results[f"{runners} runners, {replicas} gateways"] = round(rate, 1)
                    print(json.dumps({f"{runners} runners, {replicas} gateways": round(rate, 1)}), flush=True)
            finally:
                for gw in gateways:
                    gw.stop()
    finally:
        pg.stop()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
