"""Two runners (as two processes would) sharing one PostgreSQL store: every rollout is claimed once."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.request

import pytest

from lightning_dagster.engine import BatchingEngine, Engine
from lightning_dagster.gateway import EngineBackend, GatewayKeys, GatewayServer, create_app
from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.store import Store
from lightning_dagster.types import AttemptState


def post_reward(task: dict, *, base_url: str, api_key: str, event_url: str) -> float:
    body = json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    urllib.request.urlopen(
        urllib.request.Request(event_url, data=body, headers=headers, method="POST")
    ).read()
    return 1.0


@pytest.mark.postgres
def test_two_runners_on_postgresql_claim_each_rollout_exactly_once(postgres_url, model_dir, tmp_path):
    store = Store(postgres_url)
    engine = BatchingEngine(Engine(model_dir))
    app = create_app(store, EngineBackend(engine, None), keys=GatewayKeys("s" * 32, "a" * 32))
    spec = dataclasses.replace(example_harness("calc"), run_task=post_reward)
    rollouts = enqueue_tasks(store, spec, example_tasks("calc").draw("train", 12, 0), kind="train")
    ids = [r.rollout_id for r in rollouts]
    try:
        with GatewayServer(app) as server:
            runners = [
                Runner(
                    store,
                    server.url,
                    secret="s" * 32,
                    harness=spec,
                    parallel=3,
                    mode="inprocess",
                    policy=RetryPolicy(max_attempts=1),
                    workdir=tmp_path / f"r{i}",
                )  # fmt: skip
                for i in range(2)
            ]
            threads = [threading.Thread(target=r.run, args=(ids,)) for r in runners]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
    finally:
        engine.close()
    attempts = store.list_attempts(rollout_ids=ids)
    assert sorted(a.rollout_id for a in attempts) == sorted(ids)  # one attempt per rollout, no double claim
    assert {a.state for a in attempts} == {AttemptState.succeeded}
    assert len({a.worker_id.rsplit("-w", 1)[0] for a in attempts}) == 2  # both runners took a share
    assert len(store.list_rewards(rollout_ids=ids)) == 12
    store.close()
