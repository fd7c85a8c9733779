"""`RolloutService` settings change what runs (runner mode, upstream, retry policy), and `collect_batch`
keeps each rollout's final successful attempt."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import urllib.error
import urllib.request

import pytest

from lightning_dagster.gateway import GatewayKeys, gateway_options
from lightning_dagster.gateway.keys import attempt_key
from lightning_dagster.gateway.local import LocalGateway, WeightsNotServed
from lightning_dagster.gateway.server import GatewayServer
from lightning_dagster.harnesses.calc.agent import MAX_TOKENS
from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.runner import RetryPolicy, enqueue_tasks
from lightning_dagster.runner.service import RolloutService, collect_batch
from lightning_dagster.settings import ServingSettings
from lightning_dagster.types import AttemptState, RetryKind, Reward, RolloutKind, Sampling, Span, SpanKind
from tests.support.stub_upstream import create_stub_app

T1 = Sampling(temperature=1.0)
# As a subprocess: print the pid, post reward 1.0. In process (`run_task`): post reward 0.25.
SUBPROCESS_HARNESS = """
import json, os, urllib.request
print(os.getpid(), flush=True)
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""


def inprocess_reward(task: dict, *, base_url: str, api_key: str, event_url: str) -> float:
    body = json.dumps({"event_type": "reward", "data": {"value": 0.25}}).encode()
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
    urllib.request.urlopen(
        urllib.request.Request(event_url, data=body, headers=headers, method="POST")
    ).read()
    return 0.25


def failing(task: dict, **kw: str) -> float:
    raise RuntimeError("harness broke")


@pytest.fixture(scope="module")
def upstream():
    """A vLLM-shaped stub: one token id per character, as many as the call's `max_tokens`."""
    with GatewayServer(create_stub_app()) as server:
        yield server.url


@pytest.mark.parametrize(("runner_mode", "reward"), [("subprocess", 1.0), ("inprocess", 0.25)])
def test_runner_mode_decides_whether_the_harness_runs_as_a_subprocess(
    store, upstream, tmp_path, monkeypatch, runner_mode, reward
):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path))  # where the runner keeps attempt stdout
    spec = dataclasses.replace(
        example_harness("calc"), argv=(sys.executable, "-c", SUBPROCESS_HARNESS), run_task=inprocess_reward
    )
    serving = ServingSettings(upstream_url=upstream, runner_mode=runner_mode, parallel=2)
    with RolloutService(store, None, harness=spec, serving=serving) as svc:
        batch = svc.run(example_tasks("calc").draw("train", 2, 0), group=1, kind=RolloutKind.train, sampling=T1,
                        seed=1, tag=f"mode-{runner_mode}")  # fmt: skip
    assert svc.runner.mode == runner_mode
    assert batch.rewards == {r.rollout_id: reward for r in batch.rollouts}
    for r in batch.rollouts:
        (attempt,) = store.list_attempts(rollout_id=r.rollout_id)
        stdout = tmp_path / "attempts" / r.rollout_id / attempt.attempt_id / "stdout"
        if runner_mode == "subprocess":
            assert int(stdout.read_text()) not in (os.getpid(), 0)
        else:
            assert not stdout.exists()


@pytest.mark.parametrize("serving", ["thread", "process"])
def test_an_upstream_url_sends_every_call_upstream_and_refuses_weights(store, upstream, serving):
    settings = ServingSettings(upstream_url=upstream, parallel=2)
    with RolloutService(store, None, harness="calc", serving=settings, child=serving == "process") as svc:
        batch = svc.run(example_tasks("calc").draw("train", 2, 0), group=1, kind=RolloutKind.train,
                        sampling=T1, seed=2, tag=f"up-{serving}")  # fmt: skip
        with pytest.raises(WeightsNotServed, match=upstream):
            svc.load_weights({}, "res-new")
    llm = [s for spans in batch.spans.values() for s in spans if s.kind == SpanKind.llm]
    assert len(batch.spans) == 2 and llm
    hex_ids = {ord(c) for c in "0123456789abcdef"}  # the stub replies with hex digits, one id per char
    for span in llm:
        assert span.attributes["backend"] == "upstream"
        assert len(span.response_token_ids) == MAX_TOKENS and set(span.response_token_ids) <= hex_ids


@pytest.mark.parametrize("serving", ["thread", "process"])
def test_an_upstream_with_the_models_tokenizer_gets_token_id_prompts_in_either_serving(
    store, model_dir, serving
):
    """With the served model's tokenizer (`model_dir`) the gateway sends every call to the upstream's
    completions API as exact token ids, whether it runs in this process or in a child process."""
    with GatewayServer(create_stub_app()) as stub:
        settings = ServingSettings(upstream_url=stub.url, parallel=2)
        with RolloutService(
            store, model_dir, harness="calc", serving=settings, child=serving == "process"
        ) as svc:
            batch = svc.run(example_tasks("calc").draw("train", 2, 0), group=1, kind=RolloutKind.train,
                            sampling=T1, seed=4, tag=f"tok-{serving}")  # fmt: skip
        calls = dict(stub.app.state.calls)
    llm = [s for spans in batch.spans.values() for s in spans if s.kind == SpanKind.llm]
    assert llm and calls == {"completions": len(llm)}
    assert all(span.attributes["backend"] == "upstream" for span in llm)


def test_a_device_this_machine_lacks_is_a_clear_error(model_dir):
    import subprocess

    import torch

    from lightning_dagster.engine.engine import DeviceUnavailable, resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert resolve_device("cpu").type == "cpu" and resolve_device("auto").type == "cpu"
    with pytest.raises(DeviceUnavailable, match="sees 0 CUDA device"):
        resolve_device("cuda")
    with pytest.raises(DeviceUnavailable, match="is not a torch device"):
        resolve_device("gpu0")
    with pytest.raises(DeviceUnavailable, match="cuda:1"):
        options = gateway_options(ServingSettings(engine_device="cuda:1", engine_process=False))
        LocalGateway(None, model_dir, options)  # type: ignore[arg-type]
    served = subprocess.run(
        [sys.executable, "-m", "lightning_dagster.cli", "gateway", "serve", "--model", str(model_dir),
         "--store-url", "sqlite://", "--port", "0", "--engine-device", "cuda"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert served.returncode == 2, served.stderr[-2000:]
    assert "error: device 'cuda' asked for, but torch" in served.stderr and "Traceback" not in served.stderr


def test_the_retry_policy_given_is_the_one_that_runs(store, upstream):
    spec = dataclasses.replace(example_harness("calc"), run_task=failing)
    policy = RetryPolicy(max_attempts=3, timeout_s=30.0)
    serving = ServingSettings(upstream_url=upstream)
    with RolloutService(store, None, harness=spec, serving=serving, retry_policy=policy) as svc:
        batch = svc.run(example_tasks("calc").draw("train", 1, 0), group=1, kind=RolloutKind.train, sampling=T1,
                        seed=3, tag="retry")  # fmt: skip
    assert svc.retry_policy is policy and svc.runner.policy is policy
    (rollout,) = batch.rollouts
    attempts = store.list_attempts(rollout_id=rollout.rollout_id)
    assert [a.state for a in attempts] == [AttemptState.failed] * 3
    assert all("harness broke" in a.reason_message for a in attempts)
    assert batch.rewards == {} and batch.spans == {} and batch.success() == 0.0


def test_collect_batch_keeps_the_final_successful_attempt(store):
    spec = example_harness("calc")
    retried, failed = enqueue_tasks(
        store, spec, example_tasks("calc").draw("train", 2, 4), kind="train", seed=None
    )

    def span(attempt_id: str, rollout_id: str, name: str) -> Span:
        return Span(rollout_id=rollout_id, attempt_id=attempt_id, name=name, kind=SpanKind.custom)

    # `retried`: a succeeded first attempt (reward 0), then a sample retry that succeeds twice-rewarded
    _, first = store.claim_rollout("w", rollout_ids=[retried.rollout_id])
    store.add_spans([span(first.attempt_id, retried.rollout_id, "first")])
    store.add_reward(Reward(rollout_id=retried.rollout_id, attempt_id=first.attempt_id, value=0.0))
    store.transition_attempt(first.attempt_id, AttemptState.succeeded, reason_code="ok")
    second = store.start_attempt(store.retry_rollout(retried.rollout_id, RetryKind.sample).attempt_id, "w")
    store.add_spans([span(second.attempt_id, retried.rollout_id, "second")])
    store.add_reward(Reward(rollout_id=retried.rollout_id, attempt_id=second.attempt_id, value=0.5))
    store.add_reward(Reward(rollout_id=retried.rollout_id, attempt_id=second.attempt_id, value=1.0))
    store.transition_attempt(second.attempt_id, AttemptState.succeeded, reason_code="ok")
    # `failed`: rewarded, then failed: no successful attempt, so neither reward nor spans
    _, only = store.claim_rollout("w", rollout_ids=[failed.rollout_id])
    store.add_spans([span(only.attempt_id, failed.rollout_id, "only")])
    store.add_reward(Reward(rollout_id=failed.rollout_id, attempt_id=only.attempt_id, value=1.0))
    store.transition_attempt(only.attempt_id, AttemptState.failed, reason_code="exit_nonzero")

    batch = collect_batch(store, [retried, failed], seconds=2.0)
    assert batch.rewards == {retried.rollout_id: 1.0}
    assert [s.name for s in batch.spans[retried.rollout_id]] == ["second"]
    assert failed.rollout_id not in batch.spans
    assert batch.success() == 0.5 and batch.seconds == 2.0


def models(url: str, key: str) -> tuple[int, dict]:
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


def test_a_local_gateway_binds_its_port_and_trusts_its_secret_and_serve_keys(store, model_dir):
    options = gateway_options(ServingSettings(engine_process=False))
    with LocalGateway(store, model_dir, options) as probe:
        port = int(probe.url.rsplit(":", 1)[1])
    keys = GatewayKeys.fresh("fixed-secret", serve_keys=("sk-serve",))
    with LocalGateway(
        store, model_dir, options.with_serving(port=port), keys=keys, resource_id="res-p"
    ) as gw:
        assert gw.url == f"http://127.0.0.1:{port}" and gw.secret == "fixed-secret"
        status, body = models(gw.url, "sk-serve")
        assert status == 200 and body["data"][0]["id"] == "res-p"
        assert models(gw.url, attempt_key("fixed-secret", "ro-a", "at-a"))[0] == 200
        assert models(gw.url, attempt_key("another-secret", "ro-a", "at-a"))[0] == 401


@pytest.mark.parametrize("serving", ["thread", "process"])
def test_the_gateway_reports_how_full_its_engine_ran(store, model_dir, serving):
    tasks = example_tasks("calc").draw("train", 2, 0)
    settings = ServingSettings(parallel=4)
    with RolloutService(
        store, model_dir, harness="calc", serving=settings, child=serving == "process"
    ) as svc:
        before = svc.gateway.stats()["engine"]
        batch = svc.run(tasks, group=2, kind=RolloutKind.train, sampling=T1, seed=3, tag=f"stats-{serving}")
        after = svc.gateway.stats()["engine"]
    sampled = sum(
        len(s.response_token_ids) for spans in batch.spans.values() for s in spans if s.kind == "llm"
    )
    # every sampled token is one row of one decode step
    assert after["rows_stepped"] - before["rows_stepped"] == sampled > 0
    assert after["steps_run"] - before["steps_run"] <= sampled
    assert after["busy_s"] > before["busy_s"]
