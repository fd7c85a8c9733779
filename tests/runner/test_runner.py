"""The runner against the real gateway, engine and store: rollouts, endings, retries, timeouts, reaping."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.types import AttemptState, RetryKind, RolloutStatus, SpanKind

# Minimal "any language" harnesses: command lines that speak the Agent Lightning environment directly.
POST_REWARD = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""
# One real LLM call through the gateway, then SIGKILL on the rollout's first attempt; a reward afterwards.
KILL_FIRST_ATTEMPT = (
    """
import json, os, signal, sys, urllib.request
marker = os.path.join(os.environ["KILL_MARKER_DIR"], os.environ["AGL_ROLLOUT_ID"])
if not os.path.exists(marker):
    open(marker, "w").close()
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    urllib.request.urlopen(req).read()
    sys.stderr.write("dying mid-rollout\\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""
    + POST_REWARD
)
LLM_CALL = """
import json, os, sys, urllib.request
body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", method="POST",
    data=json.dumps(body).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""
# Its pid on this machine (/proc's): the harness's own getpid() is its PID namespace's.
SLEEP = "import os, time; print(os.readlink('/proc/self'), flush=True); time.sleep(60)"


def with_argv(name: str, script: str) -> HarnessSpec:
    return dataclasses.replace(example_harness(name), argv=(sys.executable, "-c", script))


def enqueue(store, spec: HarnessSpec, n: int = 1, split: str = "train", seed: int = 0) -> list[str]:
    tasks = example_tasks(spec.name).draw(split, n, seed)
    return [r.rollout_id for r in enqueue_tasks(store, spec, tasks, kind=split, seed=seed)]


def make_runner(
    store, gateway, spec, tmp_path, *, mode="subprocess", parallel=2, env_passthrough=(), **policy
) -> Runner:
    return Runner(
        store,
        gateway.url,
        secret=gateway.secret,
        harness=spec,
        parallel=parallel,
        policy=RetryPolicy(**policy),
        mode=mode,
        workdir=tmp_path,
        env_passthrough=env_passthrough,
    )


def attempts_of(store, rollout_id: str):
    return sorted(store.list_attempts(rollout_id=rollout_id), key=lambda a: a.sequence_id)


def pid_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("mode", ["subprocess", "inprocess"])
def test_calc_rollouts_through_the_real_gateway_record_llm_spans_and_rewards(
    store, gateway, model_dir, tmp_path, mode
):
    # The example project calls the agent in-process; the same module is also a standalone program.
    standalone = (sys.executable, "-m", "lightning_dagster.harnesses.calc.agent")
    spec = dataclasses.replace(example_harness("calc"), argv=standalone)
    ids = enqueue(store, spec, n=2, seed=11)
    summary = make_runner(store, gateway, spec, tmp_path, mode=mode).run(ids)

    assert summary.rollouts_by_status == {"succeeded": 2}
    assert summary.attempts_by_ending == {"succeeded": 2} and summary.reasons == {"ok": 2}
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    stored = []
    for rollout_id in ids:
        (attempt,) = attempts_of(store, rollout_id)
        spans = store.list_spans(attempt_id=attempt.attempt_id)
        llm = [s for s in spans if s.kind == SpanKind.llm]
        assert llm and {s.kind for s in spans} >= {SpanKind.llm, SpanKind.reward}
        for span in llm:
            assert span.resource_id == gateway.resource_id
            assert span.response_token_ids and len(span.response_logprobs) == len(span.response_token_ids)
        # The harness received this rollout's task: its question is in the first captured prompt.
        question = store.get_rollout(rollout_id).task["question"]
        assert question in tokenizer.decode(llm[0].prompt_token_ids, skip_special_tokens=False)
        (reward,) = [
            r for r in store.list_rewards(rollout_ids=[rollout_id]) if r.attempt_id == attempt.attempt_id
        ]
        assert reward.value in (0.0, 1.0)
        stored.append(reward.value)
        if mode == "subprocess":  # what the agent printed is what the gateway stored for its attempt
            printed = json.loads((tmp_path / rollout_id / attempt.attempt_id / "stdout").read_text())
            assert printed["reward"] == reward.value
    assert summary.reward_mean == pytest.approx(statistics.mean(stored))
    assert summary.rewards == 2 and summary.missing_rewards == 0 and summary.span_coverage == 1.0
    assert summary.llm_spans >= 2 and summary.spans >= summary.llm_spans + 2


@pytest.mark.parametrize(
    ("sample_retry_on", "expected_kind"),
    [((), RetryKind.infrastructure), (("killed",), RetryKind.sample)],
)
def test_a_harness_killed_mid_rollout_fails_with_its_reason_and_is_retried_per_policy(
    store, gateway, tmp_path, monkeypatch, sample_retry_on, expected_kind
):
    (tmp_path / "markers").mkdir()
    monkeypatch.setenv("KILL_MARKER_DIR", str(tmp_path / "markers"))
    spec = with_argv("calc", KILL_FIRST_ATTEMPT)
    ids = enqueue(store, spec, seed=5)
    runner = make_runner(
        store, gateway, spec, tmp_path, sample_retry_on=sample_retry_on, env_passthrough=["KILL_MARKER_DIR"]
    )
    summary = runner.run(ids)

    first, second = attempts_of(store, ids[0])
    assert first.state == AttemptState.failed and first.reason_code == "killed"
    assert "SIGKILL" in first.reason_message and "dying mid-rollout" in first.reason_message
    # The call the killed attempt made is kept, attributed to that attempt.
    (llm,) = store.list_spans(rollout_id=ids[0], kind=SpanKind.llm)
    assert llm.attempt_id == first.attempt_id and llm.response_token_ids
    assert second.retry_kind == expected_kind and second.sequence_id == 2
    assert second.state == AttemptState.succeeded and second.reason_code == "ok"
    assert [r.attempt_id for r in store.list_rewards(rollout_ids=ids)] == [second.attempt_id]
    assert store.get_rollout(ids[0]).status == RolloutStatus.succeeded
    assert summary.retries_by_kind == {expected_kind.value: 1}
    assert summary.attempts_by_ending == {"failed": 1, "succeeded": 1}


def test_retries_stop_at_max_attempts_and_undeclared_endings_are_not_retried(store, gateway, tmp_path):
    spec = with_argv("calc", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    ids = enqueue(store, spec, seed=6)
    summary = make_runner(store, gateway, spec, tmp_path, max_attempts=3).run(ids)
    attempts = attempts_of(store, ids[0])
    assert [a.state for a in attempts] == [AttemptState.failed] * 3
    assert [a.retry_kind for a in attempts] == [RetryKind.first] + [RetryKind.infrastructure] * 2
    assert store.get_rollout(ids[0]).status == RolloutStatus.failed
    assert summary.rollouts_by_status == {"failed": 1} and summary.reward_mean is None

    spec = with_argv("calc", "import sys; sys.stderr.write('bad config: no model'); sys.exit(3)")
    ids = enqueue(store, spec, seed=7)
    make_runner(store, gateway, spec, tmp_path, retry_on=("timeout",)).run(ids)
    (only,) = attempts_of(store, ids[0])
    assert only.reason_code == "exit_nonzero"
    assert "status 3" in only.reason_message and "bad config: no model" in only.reason_message


def test_a_harness_past_its_deadline_is_killed_and_ends_in_timeout(store, gateway, tmp_path):
    spec = with_argv("calc", SLEEP)
    ids = enqueue(store, spec, seed=8)
    started = time.monotonic()
    summary = make_runner(store, gateway, spec, tmp_path, timeout_s=0.5, max_attempts=1).run(ids)
    assert time.monotonic() - started < 10
    (attempt,) = attempts_of(store, ids[0])
    assert attempt.state == AttemptState.timeout and attempt.reason_code == "timeout"
    assert "0.5s timeout" in attempt.reason_message
    pid = int((tmp_path / ids[0] / attempt.attempt_id / "stdout").read_text())
    assert pid_is_gone(pid)
    assert summary.attempts_by_ending == {"timeout": 1}


def test_a_harness_printing_past_its_output_cap_keeps_its_reward_and_spans(store, gateway, tmp_path):
    # An LLM call and a reward, with 50 MB of stdout between them (a pipe left unread would block it).
    script = LLM_CALL + "sys.stdout.write('y\\n' * 25_000_000)\nsys.stdout.flush()\n" + POST_REWARD
    cap = 64 * 1024
    spec = dataclasses.replace(with_argv("calc", script), max_output_bytes=cap)
    ids = enqueue(store, spec, seed=14)
    summary = make_runner(store, gateway, spec, tmp_path).run(ids)
    (attempt,) = attempts_of(store, ids[0])
    assert attempt.state == AttemptState.succeeded and attempt.reason_code == "ok"
    dropped = 50_000_000 - cap
    assert (
        attempt.reason_message
        == f"stdout truncated: 50,000,000 bytes printed, {dropped:,} dropped from the middle"
    )
    kinds = [s.kind for s in store.list_spans(attempt_id=attempt.attempt_id)]
    assert kinds.count(SpanKind.llm) == 1 and SpanKind.reward in kinds
    assert summary.reward_mean == 1.0 and summary.rewards == 1
    stdout = (tmp_path / ids[0] / attempt.attempt_id / "stdout").read_bytes()
    assert len(stdout) < cap + 200 and f"{dropped:,} bytes of stdout dropped here".encode() in stdout


def test_an_inprocess_harness_past_its_deadline_ends_in_timeout(store, gateway, tmp_path):
    spec = dataclasses.replace(example_harness("calc"), run_task=lambda task, **kw: time.sleep(3))
    ids = enqueue(store, spec, seed=9)
    make_runner(store, gateway, spec, tmp_path, mode="inprocess", timeout_s=0.3, max_attempts=1).run(ids)
    (attempt,) = attempts_of(store, ids[0])
    assert attempt.state == AttemptState.timeout and "abandoned" in attempt.reason_message


def test_an_attempt_whose_worker_stopped_heartbeating_is_reaped_and_retried(store, gateway, tmp_path):
    spec = with_argv("calc", POST_REWARD)
    ids = enqueue(store, spec, seed=10)
    # A worker (in some other process) claims the rollout and dies: its attempt stays `running`.
    _, orphan = store.claim_rollout("crashed-worker", rollout_ids=ids)
    # A limit a live worker meets on a loaded machine (its heartbeat every limit/4), passed by the orphan.
    time.sleep(3.1)
    summary = make_runner(store, gateway, spec, tmp_path, heartbeat_timeout_s=3.0).run(ids)

    first, second = attempts_of(store, ids[0])
    assert first.attempt_id == orphan.attempt_id and first.worker_id == "crashed-worker"
    assert first.state == AttemptState.unresponsive and first.reason_code == "no_heartbeat"
    assert second.retry_kind == RetryKind.infrastructure and second.state == AttemptState.succeeded
    assert summary.attempts_by_ending == {"unresponsive": 1, "succeeded": 1}
    assert summary.reward_mean == 1.0


def test_a_cancelled_attempt_stops_its_running_harness(store, gateway, tmp_path):
    spec = with_argv("calc", SLEEP)
    ids = enqueue(store, spec, seed=12)

    def cancel_when_running() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            running = store.list_attempts(rollout_ids=ids, state=AttemptState.running)
            # Once the harness has printed its pid it is certainly running.
            stdout = tmp_path / ids[0] / (running[0].attempt_id if running else "-") / "stdout"
            if running and stdout.exists() and stdout.read_text():
                store.transition_attempt(
                    running[0].attempt_id, AttemptState.cancelled, reason_code="operator"
                )
                return
            time.sleep(0.05)

    canceller = threading.Thread(target=cancel_when_running)
    canceller.start()
    summary = make_runner(store, gateway, spec, tmp_path, heartbeat_timeout_s=0.4).run(ids)
    canceller.join()
    (attempt,) = attempts_of(store, ids[0])
    assert attempt.state == AttemptState.cancelled and attempt.reason_code == "operator"
    assert store.get_rollout(ids[0]).status == RolloutStatus.cancelled
    pid = int((tmp_path / ids[0] / attempt.attempt_id / "stdout").read_text())
    assert pid_is_gone(pid)
    assert summary.rollouts_by_status == {"cancelled": 1}


def test_a_harness_that_exits_cleanly_without_a_reward_is_reported(store, gateway, tmp_path, monkeypatch):
    monkeypatch.setenv("LD_GATEWAY_SECRET", "must-not-leak")
    script = (
        "import json, os; print(json.dumps(sorted(k for k in os.environ if k.startswith(('LD_', 'AGL_')))))"
    )
    spec = with_argv("calc", script)
    ids = enqueue(store, spec, seed=13)
    summary = make_runner(store, gateway, spec, tmp_path).run(ids)
    (attempt,) = attempts_of(store, ids[0])
    # The harness sees its attempt's variables (LD_TASK is its task) and none of the project's secrets.
    seen = json.loads((tmp_path / ids[0] / attempt.attempt_id / "stdout").read_text())
    assert seen == [
        "AGL_ATTEMPT_ID",
        "AGL_EVENT_URL",
        "AGL_KEY",
        "AGL_OPENAI_BASE_URL",
        "AGL_ROLLOUT_ID",
        "AGL_TASK",
        "LD_TASK",
        "LD_TASK_FILE",
    ]
    assert attempt.state == AttemptState.succeeded and attempt.reason_code == "no_reward"
    assert summary.missing_rewards == 1 and summary.rewards == 0 and summary.reward_mean is None


def test_ledger_effects_are_verified_by_requery_and_a_delete_is_flagged_harmful(store, gateway, tmp_path):
    spec = example_harness("ledger")
    ids = enqueue(store, spec, split="canary", seed=14)
    summary = make_runner(store, gateway, spec, tmp_path, mode="inprocess").run(ids)
    (effect,) = store.list_spans(rollout_id=ids[0], kind=SpanKind.custom)
    assert effect.name == "effect" and effect.attributes["verified"] is True
    assert summary.effects["verified"] == 1 and summary.span_coverage == 1.0

    # A harness that deletes the row and claims success: the reward says 1.0, the destination says harm.
    deleting = with_argv(
        "ledger",
        "import json, os, sqlite3\n"
        "t = json.loads(os.environ['AGL_TASK'])\n"
        "c = sqlite3.connect(t['db_path']); c.execute('DELETE FROM accounts WHERE name = ?', (t['account'],))\n"
        "c.commit()\n" + POST_REWARD,
    )
    ids = enqueue(store, deleting, split="protected", seed=15)
    summary = make_runner(store, gateway, deleting, tmp_path).run(ids)
    (effect,) = store.list_spans(rollout_id=ids[0], kind=SpanKind.custom)
    assert effect.attributes["harmful_effect"] is True and effect.attributes["effect_ok"] is False
    assert effect.status == "ok"  # verified: the destination was read back
    assert summary.reward_mean == 1.0 and summary.effects == {
        "attempts": 1,
        "verified": 1,
        "effect_ok": 0,
        "harmful": 1,
    }


def test_the_gateway_accepts_the_agents_tool_turn_as_the_agent_sends_it(store, gateway, model_dir):
    """The tool-result turn (assistant tool call without content, then a `tool` message) is rare from an
    untrained model, so send the ideal episode's prefix ourselves with the real client and attempt key."""
    from openai import OpenAI

    from lightning_dagster.gateway import attempt_key
    from lightning_dagster.harnesses.calc import agent
    from lightning_dagster.harnesses.calc.demos import demo_messages

    spec = example_harness("calc")
    ids = enqueue(store, spec, seed=16)
    rollout, attempt = store.claim_rollout("test-worker", rollout_ids=ids)
    key = attempt_key(gateway.secret, rollout.rollout_id, attempt.attempt_id)
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)
    messages = demo_messages(rollout.task)
    reply = client.chat.completions.create(
        model="policy", messages=messages[:4], tools=agent.TOOLS, max_tokens=8, temperature=0.0
    )
    # The untrained base model does not end its turn within 8 greedy tokens: cut off at the limit.
    assert reply.choices[0].finish_reason == "length"
    (span,) = store.list_spans(attempt_id=attempt.attempt_id, kind=SpanKind.llm)
    assert span.finish_reason == "length" and len(span.response_token_ids) == 8
    # the assistant's tool call (content None) was rendered into the prompt
    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompt = tokenizer.decode(span.prompt_token_ids, skip_special_tokens=False)
    assert json.loads(messages[2]["tool_calls"][0]["function"]["arguments"])["expression"] in prompt
    store.transition_attempt(attempt.attempt_id, AttemptState.succeeded, reason_code="ok")
