"""The retry policy's decisions, and `lightning-dagster rollouts run` against the real gateway."""

from __future__ import annotations

import json

import pytest

from lightning_dagster.cli import main
from lightning_dagster.runner import InvalidPolicy, RetryPolicy
from lightning_dagster.types import Attempt, AttemptState, RetryKind, SpanKind
from tests.support.secrets import gateway_args, secret_file


def ended(state: str, reason: str | None = None, seq: int = 1) -> Attempt:
    return Attempt(rollout_id="ro-x", sequence_id=seq, state=AttemptState(state), reason_code=reason)


def test_policy_tells_sample_retries_from_infrastructure_retries():
    policy = RetryPolicy(max_attempts=3, sample_retry_on=("no_reward",))
    assert policy.retry_kind(ended("failed", "killed")) == RetryKind.infrastructure
    assert policy.retry_kind(ended("timeout", "timeout")) == RetryKind.infrastructure
    assert policy.retry_kind(ended("succeeded", "no_reward")) == RetryKind.sample
    assert policy.retry_kind(ended("succeeded", "ok")) is None
    assert policy.retry_kind(ended("cancelled", "operator")) is None
    assert policy.retry_kind(ended("failed", "killed", seq=3)) is None  # budget spent
    # Reason codes are endings too: retry only what is declared.
    assert RetryPolicy(retry_on=("killed",)).retry_kind(ended("failed", "exit_nonzero")) is None
    assert RetryPolicy(retry_on=["killed"]).to_dict()["retry_on"] == ["killed"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"timeout_s": 0},
        {"heartbeat_timeout_s": -1},
        # NaN compares false both ways and infinity never passes: neither would ever end an attempt
        {"timeout_s": float("nan")},
        {"timeout_s": float("inf")},
        {"heartbeat_timeout_s": float("nan")},
        {"backoff_max_s": float("nan")},
        {"backoff_s": float("nan")},
    ],
)
def test_an_unusable_policy_is_refused(kwargs):
    with pytest.raises(InvalidPolicy):
        RetryPolicy(**kwargs)


def test_cli_runs_rollouts_through_a_gateway_and_prints_the_summary(store, gateway, capsys, tmp_path):
    argv = ["rollouts", "run", "--harness", "calc", "--split", "holdout", "--n", "1", "--group-size", "2"]
    argv += gateway_args(gateway, store, tmp_path)
    assert main(argv + ["--runner-mode", "inprocess", "--json"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out)
    assert summary["rollouts"] == 2 and summary["attempts_by_ending"] == {"succeeded": 2}, out
    assert summary["rewards"] == 2, out
    ids = summary["rollout_ids"]
    assert summary["llm_spans"] == len(store.list_spans(rollout_ids=ids, kind=SpanKind.llm)) >= 2
    assert summary["reward_mean"] == pytest.approx(
        sum(r.value for r in store.list_rewards(rollout_ids=ids)) / 2
    )
    rollouts = [store.get_rollout(rid) for rid in ids]
    assert {r.kind.value for r in rollouts} == {"holdout"} and len({r.group_id for r in rollouts}) == 1
    assert len({r.metadata["sampling_seed"] for r in rollouts}) == 2  # group members sample differently


def test_cli_without_a_gateway_serves_a_local_one_that_forwards_upstream(store, capsys):
    from lightning_dagster.gateway.server import GatewayServer
    from tests.support.stub_upstream import create_stub_app

    argv = [
        "rollouts",
        "run",
        "--harness",
        "calc",
        "--n",
        "2",
        "--group-size",
        "1",
        "--store-url",
        store.url,
        "--runner-mode",
        "inprocess",
    ]
    with GatewayServer(create_stub_app()) as upstream:
        assert main(argv + ["--upstream-url", upstream.url, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rollouts_by_status"] == {"succeeded": 2}
    llm = store.list_spans(rollout_ids=summary["rollout_ids"], kind=SpanKind.llm)
    assert len(llm) == summary["llm_spans"] >= 2
    assert {s.attributes["backend"] for s in llm} == {"upstream"}


def test_cli_with_an_upstream_and_its_tokenizer_sends_token_id_prompts(store, model_dir, capsys):
    """`--tokenizer` with `--upstream-url` reaches the local gateway: every prompt goes upstream as exact
    token ids through the completions API (the tokenizer was dropped, so every call took the chat API)."""
    from lightning_dagster.gateway.server import GatewayServer
    from tests.support.stub_upstream import create_stub_app

    argv = ["rollouts", "run", "--harness", "calc", "--n", "2", "--group-size", "1", "--store-url", store.url, "--json"]
    with GatewayServer(create_stub_app()) as upstream:
        assert main(argv + ["--upstream-url", upstream.url, "--tokenizer", str(model_dir)]) == 0
        calls = dict(upstream.app.state.calls)
    summary = json.loads(capsys.readouterr().out)
    assert summary["rollouts_by_status"] == {"succeeded": 2}
    assert summary["llm_spans"] >= 2 and calls == {"completions": summary["llm_spans"]}


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--tokenizer", "."], "--tokenizer goes with --upstream-url"),
        (["--model", ".", "--upstream-url", "http://127.0.0.1:9"], "with --upstream-url give the served"),
        (["--engine-threads", "0"], "--engine-threads"),
        (["--gateway", "http://127.0.0.1:9", "--max-batch", "8"], "--max-batch set the local gateway"),
    ],
)
def test_cli_refuses_serving_flags_that_do_not_go_together(store, capsys, flags, said):
    argv = ["rollouts", "run", "--harness", "calc", "--n", "1", "--group-size", "1", "--store-url", store.url]
    before = len(store.query_rollouts())
    assert main(argv + flags) == 2
    assert said in capsys.readouterr().err
    assert len(store.query_rollouts()) == before  # refused before anything was queued


def test_cli_refuses_a_gateway_without_its_secret(monkeypatch, capsys):
    monkeypatch.delenv("LD_GATEWAY_SECRET", raising=False)
    assert main(["rollouts", "run", "--harness", "calc", "--n", "1", "--group-size", "1", "--gateway", "http://127.0.0.1:9"]) == 2
    assert "--gateway needs that gateway's secret: --secret-file PATH" in capsys.readouterr().err


def test_a_runner_refuses_unknown_or_foreign_rollouts_before_running_anything(store, gateway, tmp_path):
    from lightning_dagster.project.examples import example_harness, example_tasks
    from lightning_dagster.runner import Runner, WrongHarness, enqueue_tasks
    from lightning_dagster.store import NotFound

    ledger = example_harness("ledger")
    (rollout,) = enqueue_tasks(store, ledger, example_tasks("ledger").draw("train", 1, 0), kind="train")
    runner = Runner(
        store, gateway.url, secret=gateway.secret, harness=example_harness("calc"), workdir=tmp_path
    )
    with pytest.raises(WrongHarness, match="calc"):
        runner.run([rollout.rollout_id])
    with pytest.raises(NotFound, match="ro-nope"):
        runner.run(["ro-nope"])
    assert store.list_attempts(rollout_id=rollout.rollout_id) == []


@pytest.mark.parametrize(
    "command", [["rollouts", "run", "--n", "1", "--group-size", "1"], ["runner", "--gateway", "http://127.0.0.1:9"]]
)
@pytest.mark.parametrize("parallel", ["-2", "two"])
def test_a_parallelism_below_zero_is_refused_before_anything_is_queued(store, capsys, command, parallel):
    """0 is auto (`ServingSettings.parallel`); below it, or not a number, exits 2 naming the flag."""
    before = len(store.query_rollouts())
    try:
        status = main([*command, "--harness", "calc", "--store-url", store.url, "--parallel", parallel])
    except SystemExit as caught:  # argparse: not a whole number
        status = caught.code
    assert status == 2
    assert "--parallel" in capsys.readouterr().err
    assert len(store.query_rollouts()) == before


def test_a_run_id_resumes_only_the_run_it_was_queued_for(tmp_path, capsys):
    store = ["--store-url", f"sqlite:///{tmp_path / 'store.db'}"]
    enqueue = ["rollouts", "enqueue", "--harness", "calc", "--n", "3", "--group-size", "1", "--run-id", "r1", *store]
    assert main(enqueue) == 0
    assert json.loads(capsys.readouterr().out) == {"run_id": "r1", "rollouts": 3, "harness": "calc"}
    assert main(enqueue) == 0  # the same command resumes it: nothing queued twice
    assert json.loads(capsys.readouterr().out)["rollouts"] == 3
    for change, fragment in [
        (["--harness", "ledger"], "harness calc, not ledger"),
        (["--group-size", "2"], "groups of 1, not 2 (--group-size)"),
        (["--n", "2"], "more than 2 task(s), not 2 (--n)"),
        (["--n", "5"], "3 task(s), not 5 (--n)"),
        (["--split", "holdout"], "split train, not holdout"),
        (["--seed", "7"], "other tasks, or another --seed"),
    ]:
        assert main([*enqueue, *change]) == 2, change  # a later option overrides the earlier
        err = capsys.readouterr().err
        assert "run r1 was queued with other settings" in err and fragment in err, (change, err)
    # `rollouts run` resumes through the same check: a foreign run id was a WrongHarness traceback
    secret = secret_file(tmp_path, "s" * 32)
    run = ["rollouts", "run", "--harness", "ledger", "--n", "3", "--group-size", "1", "--run-id", "r1", *store]
    assert main([*run, "--gateway", "http://127.0.0.1:9", "--secret-file", secret]) == 2
    assert "harness calc, not ledger" in capsys.readouterr().err
    from lightning_dagster.store import Store

    assert len(Store(store[1]).query_rollouts()) == 3
