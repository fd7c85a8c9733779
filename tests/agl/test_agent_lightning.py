"""Agent Lightning 1.0.2's own client, local controller and an agent written for it, run from its Python 3.12
venv against `lightning-dagster gateway serve --agl-key-file` (a child process over a SQLite file), with and
without a hard kill and restart of the server between submitting and collecting."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightning_dagster.store import Store
from lightning_dagster.types import AttemptState
from tests.agl.conftest import TRAIN_T
from tests.support.agl_venv import Python312Missing, ensure_agl_venv
from tests.support.secrets import free_port, secret_file

AGL_SIDE = Path(__file__).parent / "agl_side"
KEY = "agl-cli-key-0123456789"


@pytest.fixture(scope="module")
def agl_python() -> str:
    try:
        return str(ensure_agl_venv())
    except Python312Missing as exc:
        pytest.skip(f"Agent Lightning 1.0.2 needs Python 3.12: {exc}")


class CliServer:
    """`lightning-dagster gateway serve --upstream STUB --agl-key-file F --store sqlite:///...`."""

    def __init__(self, directory: Path, upstream: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.store_url = f"sqlite:///{directory / 'agl.db'}"
        self.cmd = [
            sys.executable,
            "-m",
            "lightning_dagster.cli",
            "gateway",
            "serve",
            "--port",
            str(self.port),
        ]
        self.cmd += ["--upstream-url", upstream, "--store-url", self.store_url]
        self.cmd += ["--secret-file", secret_file(directory, "cli-secret-0123456789")]
        self.cmd += ["--admin-key-file", secret_file(directory, "cli-admin-0123456789", "admin")]
        self.cmd += ["--agl-key-file", secret_file(directory, KEY, "agl.key")]
        self.cmd += ["--agl-train-temperature", str(TRAIN_T)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{self.url}/healthz").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"gateway serve did not come up: {self.proc.stderr.read()}")
            time.sleep(0.2)

    def kill(self) -> None:
        """A crash, not a shutdown: nothing gets to flush."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def drive(python: str, step: str, url: str) -> dict:
    env = {**os.environ, "AGL_SERVER_KEY": KEY, "PYTHONPATH": str(AGL_SIDE)}
    done = subprocess.run(
        [python, str(AGL_SIDE / "driver.py"), step, url], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("restart", [False, True], ids=["one-server", "killed-and-restarted"])
def test_agent_lightnings_client_controller_and_agent_run_unchanged_against_the_durable_server(
    agl_python, tmp_path, stub, restart
):
    server = CliServer(tmp_path, f"{stub.url}/v1")
    server.start()
    try:
        submitted = drive(agl_python, "submit", server.url)
        if restart:
            server.kill()
            server.start()
        collected = drive(agl_python, "collect", server.url)
    finally:
        server.stop()

    ids = ["agl-0", "agl-1", "agl-2"]
    assert submitted["created"] == ["queuing"] * 3
    assert submitted["states"] == dict.fromkeys(ids, "succeeded")
    assert submitted["paused"]["paused"] is True and submitted["paused_call"] == 429
    assert submitted["retry_after"] == "5"
    assert collected["state_before_resume"]["paused"] is True  # the pause survives a restart
    assert collected["state_after_resume"]["paused"] is False
    assert collected["states"] == dict.fromkeys(ids, "succeeded")
    assert collected["rewards"] == {"agl-0": [3.0], "agl-1": [4.0], "agl-2": [5.0]}
    assert collected["terminal"]["total_terminal"] == 3
    assert sorted(i["rollout_id"] for i in collected["terminal"]["items"]) == ids

    with Store(server.store_url) as store:
        for rid in ids:
            (attempt,) = store.list_attempts(rollout_id=rid)
            assert attempt.state is AttemptState.succeeded and attempt.worker_id == "agl"
            spans = store.list_spans(rollout_id=rid, kind="llm")
            assert [s.attributes["temperature"] for s in spans] == [TRAIN_T, TRAIN_T]
            assert [s.attributes["requested"]["temperature"] for s in spans] == [0.0, 0.0]
            expected = [[s.prompt_token_ids, s.response_token_ids, s.response_logprobs] for s in spans]
            assert collected["triplets"][rid] == expected
            first, second = spans
            assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
