"""Harness processes get a scrubbed environment and cannot read the gateway's secrets from /proc; with the
bubblewrap sandbox they cannot see the gateway's or the runner's process at all."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_dagster.gateway import GatewayKeys, gateway_options
from lightning_dagster.gateway.local import LocalGateway
from lightning_dagster.gateway.server import GatewayServer
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.runner.execute import (
    INHERITED_ENV,
    MAX_ENV_STRING,
    SandboxUnavailable,
    check_passthrough,
    check_sandbox,
    harness_env,
    task_note,
)
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.settings import ServingSettings
from lightning_dagster.types import AttemptState, RolloutStatus
from tests.support.stub_upstream import create_stub_app

# Reads /proc/<pid>/environ and cmdline of every pid in its task (a missing or unreadable entry is reported
# as such), its own environment, and the listing of a directory; posts a reward with its attempt key.
PROBE = """
import json, os, sys, urllib.request
task = json.loads(sys.stdin.read())
def read(path):
    try:
        with open(path, "rb") as fh:
            return fh.read().decode("utf-8", "replace")
    except OSError as exc:
        return "unreadable: " + type(exc).__name__
seen = {"proc": {str(pid): {part: read(f"/proc/{pid}/{part}") for part in ("environ", "cmdline")}
                 for pid in task["pids"]},
        "env": dict(os.environ),
        "pids_visible": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "listing": sorted(os.listdir(task["listing"])) if os.path.isdir(task["listing"]) else None}
print(json.dumps(seen))
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""
PROBE_SPEC = HarnessSpec(name="probe", expected_span_families=(), argv=(sys.executable, "-c", PROBE))


@pytest.fixture(scope="module")
def process_gateway(store):
    """A gateway in a child process, as the training loop runs it, forwarding to a stub upstream."""
    with GatewayServer(create_stub_app()) as upstream:
        options = gateway_options(ServingSettings(upstream_url=upstream.url))
        keys = GatewayKeys.fresh(serve_keys=("sk-1",))
        with LocalGateway(store, None, options, keys=keys, child=True) as gw:
            yield gw


def probe(
    store, gateway, tmp_path, *, listing: Path | None = None, workdir: Path | None = None, **runner_kw
) -> dict:
    """Run PROBE once through a real runner (attempt files under `workdir`); returns what it saw."""
    workdir = workdir or tmp_path / "attempts"
    task = {
        "task_id": tmp_path.name,
        "family": "probe",
        "pids": [gateway.pid, os.getpid()],
        "listing": str(listing or tmp_path),
    }
    (rollout,) = enqueue_tasks(store, PROBE_SPEC, [task], kind="train")
    runner = Runner(
        store, gateway.url, secret=gateway.secret, harness=PROBE_SPEC, workdir=workdir,
        policy=RetryPolicy(timeout_s=60), **runner_kw,
    )  # fmt: skip
    runner.run([rollout.rollout_id])
    (attempt,) = store.list_attempts(rollout_id=rollout.rollout_id)
    out = workdir / rollout.rollout_id / attempt.attempt_id / "stdout"
    assert attempt.state == AttemptState.succeeded and attempt.reason_code == "ok", attempt.reason_message
    assert store.get_rollout(rollout.rollout_id).status == RolloutStatus.succeeded
    return json.loads(out.read_text())


def secrets_of(gateway: LocalGateway) -> list[str]:
    return [gateway.secret, gateway._process.admin_key, "sk-1"]


def test_a_harness_finds_no_secret_in_the_gateway_child_the_runner_or_its_own_environment(
    store, process_gateway, tmp_path, monkeypatch
):
    # The runner's own environment holds a secret too: it must not reach the harness either.
    monkeypatch.setenv("LD_GATEWAY_SECRET", "runner-env-secret")
    seen = probe(store, process_gateway, tmp_path)
    child, parent = (seen["proc"][str(pid)] for pid in (process_gateway.pid, os.getpid()))
    # Same user, no sandbox: the entries are readable, and hold none of the gateway's secrets.
    for entry in (child, parent):
        assert not entry["environ"].startswith("unreadable") and entry["cmdline"]
        for secret in secrets_of(process_gateway):
            assert secret not in entry["environ"] and secret not in entry["cmdline"]
    assert "gateway\0serve" in child["cmdline"] and "--secrets-stdin" in child["cmdline"]
    own = json.dumps(seen["env"])
    for secret in [*secrets_of(process_gateway), "runner-env-secret"]:
        assert secret not in own
    assert seen["env"]["OPENAI_API_KEY"].startswith("ld1.")  # its own attempt key, and only that


def test_a_harness_inherits_only_the_allowlist_the_passthrough_and_its_attempt_variables(
    store, process_gateway, tmp_path, monkeypatch
):
    monkeypatch.setenv("LD_STORE_URL", "postgresql://ld:hunter2@db/ld")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "mlflow-token")
    monkeypatch.setenv("LD_PIPELINE_KEY", "/srv/keys/pipeline.key")  # the key that attests receipts
    monkeypatch.setenv("DATABASE_URL", "postgresql://app:pw@db/app")
    monkeypatch.setenv("OPENAI_ORG_ID", "org-stale")
    monkeypatch.setenv("PROJECT_FLAG", "on")
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    seen = probe(store, process_gateway, tmp_path, env_passthrough=["PROJECT_FLAG"])
    attempt_vars = {"OPENAI_BASE_URL", "OPENAI_API_KEY", "AGL_OPENAI_BASE_URL", "AGL_KEY", "AGL_EVENT_URL",
                    "AGL_ROLLOUT_ID", "AGL_ATTEMPT_ID", "AGL_TASK", "LD_TASK", "LD_TASK_FILE"}  # fmt: skip
    inherited = {k for k in os.environ if k in INHERITED_ENV} | {"PROJECT_FLAG", "LC_ALL"}
    # The interpreter itself may add LC_CTYPE when it coerces the C locale.
    assert set(seen["env"]) - {"LC_CTYPE"} == attempt_vars | inherited
    assert seen["env"]["PROJECT_FLAG"] == "on" and seen["env"]["PATH"] == os.environ["PATH"]


@pytest.mark.parametrize(
    "name",
    ["LD_GATEWAY_SECRET", "LD_ADMIN_KEY", "LD_STORE_URL", "LD_PIPELINE_KEY", "MLFLOW_TRACKING_TOKEN"],
)
def test_a_passthrough_naming_a_project_setting_or_mlflow_credential_is_refused(name):
    with pytest.raises(ValueError, match=name):
        check_passthrough(["PROJECT_FLAG", name])


def bwrap_missing_reason() -> str | None:
    try:
        check_sandbox("bwrap")
    except SandboxUnavailable as exc:
        return str(exc)
    return None


needs_bwrap = pytest.mark.skipif(bwrap_missing_reason() is not None, reason=str(bwrap_missing_reason()))


@needs_bwrap
def test_a_sandboxed_harness_sees_neither_the_gateway_nor_the_runner_nor_the_home(
    store, process_gateway, tmp_path, monkeypatch
):
    home = tmp_path / "home"
    home.mkdir()
    (home / "store.db").write_text("the store")
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(home))
    # The runner's default: attempt workdirs inside the home, bound back into the sandbox.
    seen = probe(store, process_gateway, tmp_path, listing=home, workdir=home / "attempts", sandbox="bwrap")
    for pid in (process_gateway.pid, os.getpid()):
        # Unless the namespace happens to reuse the number, the entry does not exist.
        entry = seen["proc"][str(pid)]
        assert entry["environ"] == "unreadable: FileNotFoundError" or pid in seen["pids_visible"]
        assert all(secret not in entry["environ"] for secret in secrets_of(process_gateway))
    assert max(seen["pids_visible"]) < 10  # bwrap, the harness: a namespace of its own
    # The home is an empty tmpfs but for the path down to the attempt's workdir.
    assert seen["listing"] == ["attempts"] and "store.db" in os.listdir(home)


@needs_bwrap
def test_a_sandboxed_harness_is_killed_on_timeout(store, process_gateway, tmp_path):
    spec = HarnessSpec(
        name="sleeper", expected_span_families=(), argv=(sys.executable, "-c", "import time; time.sleep(60)")
    )
    (rollout,) = enqueue_tasks(store, spec, [{"task_id": "sleep", "family": "sleep"}], kind="train")
    runner = Runner(
        store, process_gateway.url, secret=process_gateway.secret, harness=spec, workdir=tmp_path,
        policy=RetryPolicy(timeout_s=1, max_attempts=1), sandbox="bwrap",
    )  # fmt: skip
    started = time.monotonic()
    runner.run([rollout.rollout_id])
    (attempt,) = store.list_attempts(rollout_id=rollout.rollout_id)
    assert attempt.state == AttemptState.timeout and time.monotonic() - started < 30


def test_an_unknown_sandbox_or_a_sandboxed_inprocess_harness_is_refused(store, process_gateway):
    with pytest.raises(ValueError, match="sandbox must be one of none, bwrap"):
        Runner(store, process_gateway.url, secret="s", harness=PROBE_SPEC, sandbox="docker")
    inprocess = HarnessSpec(name="fn", expected_span_families=(), run_task=lambda task, **kw: 1.0)
    with pytest.raises(ValueError, match="needs a subprocess"):
        Runner(store, process_gateway.url, secret="s", harness=inprocess, sandbox="bwrap")


def test_rollouts_run_reads_the_gateways_secret_from_stdin(store, gateway, monkeypatch, capsys):
    from lightning_dagster.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO(gateway.secret + "\n"))
    argv = [
        "rollouts",
        "run",
        "--harness",
        "calc",
        "--n",
        "1",
        "--group-size",
        "1",
        "--runner-mode",
        "inprocess",
        "--json",
    ]
    assert main(argv + ["--gateway", gateway.url, "--secret-file", "-", "--store-url", store.url]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["attempts_by_ending"] == {"succeeded": 1} and summary["rewards"] == 1


def test_a_task_is_in_ld_task_up_to_linuxs_limit_for_one_environment_string_and_not_one_byte_more(tmp_path):
    prefix = '{"t": "'  # the task JSON is prefix + filler + '"}'
    at_limit = prefix + "x" * (MAX_ENV_STRING - len("AGL_TASK=") - 1 - len(prefix) - 2) + '"}'
    file = tmp_path / "task.json"
    for task_json, kept in ((at_limit, True), (at_limit[:-2] + 'x"}', False)):
        env = harness_env("http://gw", "key", "ro-1", "at-1", task_json, task_file=file)
        assert ("AGL_TASK" in env, "LD_TASK" in env, env["LD_TASK_FILE"]) == (kept, kept, str(file))
        assert (task_note(env, task_json) == "") is kept
        # the limit is Linux's own: the environment that keeps the task starts a program
        if kept:
            assert subprocess.run(["true"], env=env).returncode == 0
        else:
            with pytest.raises(OSError, match="Argument list too long"):
                subprocess.run(["true"], env={**env, "AGL_TASK": task_json})
    # without a task file (an in-process attempt, which gets the task as an argument) nothing is noted
    env = harness_env("http://gw", "key", "ro-1", "at-1", at_limit + " ")
    assert "LD_TASK" not in env and "LD_TASK_FILE" not in env and task_note(env, at_limit + " ") == ""
