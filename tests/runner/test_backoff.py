"""Infrastructure retries back off, and a runner rides out a gateway outage shorter than its backoff cap
instead of spending every attempt on it; a longer one ends the rollout with "gateway unreachable"."""

from __future__ import annotations

import dataclasses
import threading

from lightning_dagster.engine import BatchingEngine, Engine
from lightning_dagster.gateway import EngineBackend, GatewayKeys, GatewayServer, create_app
from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.types import AttemptState, RetryKind, RolloutStatus
from tests.runner.test_postgres import post_reward
from tests.support.secrets import free_port

SECRET = "s" * 32


def run_against(store, port: int, policy: RetryPolicy, tmp_path) -> list[str]:
    spec = dataclasses.replace(example_harness("calc"), run_task=post_reward)
    rollouts = enqueue_tasks(store, spec, example_tasks("calc").draw("train", 1, 0), kind="train")
    ids = [r.rollout_id for r in rollouts]
    runner = Runner(
        store, f"http://127.0.0.1:{port}", secret=SECRET, harness=spec, parallel=1, mode="inprocess",
        policy=policy, workdir=tmp_path,
    )  # fmt: skip
    runner.run(ids)
    return ids


def test_a_gateway_that_stays_down_ends_the_rollout_with_gateway_unreachable(store, tmp_path):
    port = free_port()
    policy = RetryPolicy(max_attempts=3, backoff_s=0.2, backoff_max_s=0.4)
    ids = run_against(store, port, policy, tmp_path)
    assert store.get_rollout(ids[0]).status == RolloutStatus.failed
    attempts = store.list_attempts(rollout_id=ids[0])
    assert [a.reason_code for a in attempts] == ["gateway_unreachable"] * 3
    assert all(
        a.reason_message.startswith(f"gateway unreachable at http://127.0.0.1:{port}") for a in attempts
    )
    assert [a.retry_kind for a in attempts[1:]] == [RetryKind.infrastructure] * 2
    # each retry waited its backoff (0.2 s, then 0.4 s) after the attempt before it ended
    waits = [b.started_at - a.ended_at for a, b in zip(attempts, attempts[1:], strict=False)]
    assert waits[0] >= 0.2 and waits[1] >= 0.4


def test_an_outage_shorter_than_the_backoff_cap_costs_one_attempt(store, model_dir, tmp_path):
    port = free_port()
    engine = BatchingEngine(Engine(model_dir))
    server = GatewayServer(
        create_app(store, EngineBackend(engine, None), keys=GatewayKeys(SECRET, "a" * 32)), port=port
    )
    back = threading.Timer(1.5, server.start)  # the gateway comes back 1.5 s into the run
    back.start()
    try:
        ids = run_against(store, port, RetryPolicy(max_attempts=2, backoff_s=0.1, backoff_max_s=20), tmp_path)
    finally:
        back.join()
        server.stop()
        engine.close()
    attempts = store.list_attempts(rollout_id=ids[0])
    assert store.get_rollout(ids[0]).status == RolloutStatus.succeeded
    assert [(a.state, a.reason_code) for a in attempts] == [
        (AttemptState.failed, "gateway_unreachable"),
        (AttemptState.succeeded, "ok"),
    ]
