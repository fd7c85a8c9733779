"""`lightning-dagster runner`: a fleet worker runs queued rollouts of its harness against a running gateway
and reaps dead workers' attempts. Exit: 0 done (`--until-idle`, SIGTERM/SIGINT), 2 bad arguments/project."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from lightning_dagster.runner.cli import (
    add_harness_options,
    add_runner_options,
    harness_of,
    policy_of,
    secret_of,
    serving_of,
    store_of,
)
from lightning_dagster.runner.execute import check_sandbox


def register(parser: argparse.ArgumentParser) -> None:
    add_harness_options(parser)
    add_runner_options(parser)
    parser.add_argument("--gateway", required=True, help="URL of a running gateway (any replica)")
    parser.add_argument("--until-idle", action="store_true", help="exit once no rollout of the harness is "
                        "queued or running (default: keep claiming until SIGTERM)")  # fmt: skip
    parser.set_defaults(handler=_work)


def _work(args: argparse.Namespace) -> int:
    from lightning_dagster.runner.runner import Runner
    from lightning_dagster.store import Store

    serving = serving_of(args, "runner")
    secret = secret_of(args)
    check_sandbox(serving.sandbox)
    spec, _ = harness_of(args)
    policy = policy_of(args, spec)
    store = Store(store_of(args))
    runner = Runner(
        store, args.gateway, secret=secret, harness=spec, parallel=serving.attempts_at_once(), policy=policy,
        mode=serving.runner_mode, sandbox=serving.sandbox,
    )  # fmt: skip
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    claimed = runner.work(until_idle=args.until_idle, stop=stop)
    result = {"runner_id": runner.runner_id, "harness": spec.name, "claimed": claimed}
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    store.close()
    return 0
