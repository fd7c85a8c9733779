"""A rollout fleet on PostgreSQL with real processes: runner workers sharing one queue (one killed with
SIGKILL), a killed and restarted `rollouts run`, and two gateway replicas serving one attempt alternately."""

from __future__ import annotations

import collections
import signal
import subprocess
import time

import httpx
import pytest

from lightning_dagster.gateway.keys import attempt_key
from lightning_dagster.store import Store
from lightning_dagster.types import AttemptState, RetryKind, Rollout, RolloutKind, RolloutStatus
from tests.fleet.conftest import SECRET, Gateway, child_env, cli, make_project, wait_held
from tests.support.secrets import secret_file

pytestmark = pytest.mark.postgres


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def harness_runs(log) -> collections.Counter:
    return collections.Counter(line.split()[0] for line in log.read_text().splitlines())


def runner_args(gateway: Gateway, store_url: str, project, tmp_path) -> list[str]:
    return [
        "--project", str(project), "--gateway", gateway.url, "--secret-file", secret_file(tmp_path, SECRET),
        "--store-url", store_url, "--runner-mode", "inprocess", "--parallel", "4", "--heartbeat-timeout", "1",
    ]  # fmt: skip


def test_four_workers_run_400_rollouts_once_and_retry_the_killed_workers(postgres_url, model_dir, tmp_path):
    project, log = make_project(tmp_path / "project", 400), tmp_path / "runs.log"
    gateway = Gateway(tmp_path, postgres_url, model_dir)
    store = Store(postgres_url)
    workers: list[subprocess.Popen] = []
    try:
        enqueue = cli("rollouts", "enqueue", "--project", str(project), "--n", "400", "--group-size", "1", "--run-id", "fleet")
        subprocess.run([*enqueue, "--store-url", postgres_url], env=child_env(project, log), check=True)
        args = cli("runner", *runner_args(gateway, postgres_url, project, tmp_path), "--until-idle", "--json")
        env = child_env(project, log, FLEET_SLEEP="0.05")
        # the victim runs 3 harnesses, then every later one waits in flight, so the kill certainly strands
        # attempts (killed right after a poll saw them running, they had sometimes ended first on a loaded
        # machine; held only after 40 rollouts had succeeded, it once found the queue already drained)
        victim = subprocess.Popen(
            args, env={**env, "FLEET_HOLD_SELF": "1", "FLEET_FREE": "3"}, stdout=subprocess.PIPE
        )
        workers = [victim] + [subprocess.Popen(args, env=env, stdout=subprocess.PIPE) for _ in range(3)]
        wait_held(store, log, victim.pid, free=3)
        victim.send_signal(signal.SIGKILL)
        for worker in workers[1:]:
            assert worker.wait(timeout=120) == 0
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
        gateway.stop()
    ids = [r.rollout_id for r in store.query_rollouts(harness="fleet")]
    assert len(ids) == 400
    assert {r.status for r in store.query_rollouts(rollout_ids=ids)} == {RolloutStatus.succeeded}
    attempts = store.list_attempts(rollout_ids=ids)
    by_rollout = collections.defaultdict(list)
    for a in attempts:
        by_rollout[a.rollout_id].append(a)
    assert all(sum(a.state == AttemptState.succeeded for a in group) == 1 for group in by_rollout.values())
    reaped = [a for a in attempts if a.state == AttemptState.unresponsive]
    assert reaped and all(
        f"-{victim.pid}-" in a.worker_id and a.reason_code == "no_heartbeat" for a in reaped
    )
    retries = [a for a in attempts if a.retry_kind != RetryKind.first]
    assert sorted(a.rollout_id for a in retries) == sorted(a.rollout_id for a in reaped)
    assert {a.retry_kind for a in retries} == {RetryKind.infrastructure}
    assert all(f"-{victim.pid}-" not in a.worker_id for a in retries)  # retried elsewhere
    # no rollout was claimed by two workers: each attempt of a live worker ran its harness exactly once, and
    # one of the killed worker's at most once (it may die between its claim and the harness's start)
    task_of = {r.rollout_id: r.task_id for r in store.query_rollouts(rollout_ids=ids)}
    killed = collections.Counter(task_of[a.rollout_id] for a in attempts if f"-{victim.pid}-" in a.worker_id)
    live = collections.Counter(
        task_of[a.rollout_id] for a in attempts if f"-{victim.pid}-" not in a.worker_id
    )
    runs = harness_runs(log)
    assert set(runs) <= set(live) | set(killed)
    assert all(live[t] <= runs[t] <= live[t] + killed[t] for t in set(live) | set(killed)), runs
    rewarded = {r.attempt_id for r in store.list_rewards(rollout_ids=ids)}
    assert {a.attempt_id for a in attempts if a.state == AttemptState.succeeded} <= rewarded
    store.close()


def test_a_killed_rollouts_run_resumes_its_rollouts_when_restarted(postgres_url, model_dir, tmp_path):
    project, log = make_project(tmp_path / "project", 24), tmp_path / "runs.log"
    gateway = Gateway(tmp_path, postgres_url, model_dir)
    store = Store(postgres_url)
    run = cli("rollouts", "run", *runner_args(gateway, postgres_url, project, tmp_path), "--n", "24", "--group-size", "1")
    run += ["--run-id", "resumable", "--json"]
    # the run's first 4 harnesses succeed and every later one waits in flight: the kill certainly strands
    # attempts (killed after a slow poll, a run of 1 s rollouts had once finished all 24 on a loaded machine)
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "all").touch()
    env = child_env(project, log, FLEET_HOLD=str(hold), FLEET_FREE="4")
    try:
        first = subprocess.Popen(run, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: len(store.query_rollouts(status=RolloutStatus.succeeded)) >= 4, 60, "4 rollouts")
        wait_for(lambda: store.list_attempts(state=AttemptState.running), 60, "the held attempts")
        first.send_signal(signal.SIGKILL)
        first.wait()
        stranded = store.list_attempts(state=AttemptState.running)
        assert stranded  # what a killed run used to leave behind forever
        (hold / "all").unlink()
        second = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    finally:
        gateway.stop()
    assert second.returncode == 0, second.stderr
    rollouts = store.query_rollouts(group_ids=[f"resumable-g{i}" for i in range(24)])
    assert len(rollouts) == 24  # resumed, nothing queued twice
    assert {r.status for r in rollouts} == {RolloutStatus.succeeded}
    ended = {a.attempt_id: a for a in store.list_attempts(rollout_ids=[r.rollout_id for r in rollouts])}
    assert {ended[a.attempt_id].state for a in stranded} == {AttemptState.unresponsive}
    store.close()


def chat(url: str, key: str, messages: list[dict]) -> dict:
    body = {"model": "policy", "messages": messages, "max_tokens": 6}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def converse(urls: list[str], key: str) -> None:
    """Three turns, call k sent to urls[k]; each request re-sends the history with the replies."""
    messages: list[dict] = []
    for k, url in enumerate(urls):
        messages.append({"role": "user", "content": f"what is {k} plus {k}?"})
        reply = chat(url, key, messages)
        messages.append({"role": "assistant", "content": reply["content"]})


def test_two_gateway_replicas_serve_one_attempt_alternately_with_exact_spans(
    postgres_url, model_dir, tmp_path
):
    store = Store(postgres_url)
    sampling = {"temperature": 1.0, "top_p": 1.0, "max_tokens": 6}
    made = [
        Rollout(
            kind=RolloutKind.train, task_id="t", task={}, metadata={"sampling_seed": 7, "sampling": sampling}
        )
        for _ in range(2)
    ]
    store.enqueue_rollouts(made)
    (r1, a1), (r2, a2) = (store.claim_rollout("test") for _ in range(2))
    for i in range(2):
        (tmp_path / f"g{i}").mkdir()
    replicas = [Gateway(tmp_path / f"g{i}", postgres_url, model_dir) for i in range(2)]
    try:
        a, b = replicas[0].url, replicas[1].url
        converse([a, b, a], attempt_key(SECRET, r1.rollout_id, a1.attempt_id))  # alternating replicas
        converse([a, a, a], attempt_key(SECRET, r2.rollout_id, a2.attempt_id))  # one replica: the reference
        store.transition_attempt(a1.attempt_id, AttemptState.succeeded)
        refused = httpx.post(
            f"{b}/v1/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {attempt_key(SECRET, r1.rollout_id, a1.attempt_id)}"},
        )
        assert refused.status_code == 409  # an ended attempt is refused by every replica at once
    finally:
        for replica in replicas:
            replica.stop()
    alternated, reference = (store.list_spans(attempt_id=x.attempt_id, kind="llm") for x in (a1, a2))
    assert [s.sequence for s in alternated] == [0, 1, 2]
    assert [s.attributes["token_in"] for s in alternated] == [False, True, True]
    for got, want in zip(alternated, reference, strict=True):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.response_token_ids == want.response_token_ids
        assert got.attributes["seed"] == want.attributes["seed"]
    for before, after in zip(alternated, alternated[1:], strict=False):
        assert after.prompt_token_ids[: len(before.prompt_token_ids) + len(before.response_token_ids)] == (
            before.prompt_token_ids + before.response_token_ids
        )
    store.close()
