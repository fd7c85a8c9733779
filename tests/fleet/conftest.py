"""The fleet's processes: a gateway CLI per replica, a tiny in-process project, runner CLIs, all over one
PostgreSQL store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from lightning_dagster.engine import build_base_model
from lightning_dagster.harnesses.corpus import training_corpus
from tests.support.secrets import free_port, secret_file

SECRET, ADMIN = "s" * 32, "a" * 32
AGENT = """
import os, time


def solve(task, client):
    pid, log = os.getpid(), os.environ["FLEET_LOG"]
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.write(fd, f"{task['task_id']} {pid}\\n".encode())
    end = os.lseek(fd, 0, os.SEEK_CUR)  # the end of this line: appends are atomic
    os.close(fd)
    with open(log, "rb") as f:
        earlier = f.read(end).count(f" {pid}\\n".encode()) - 1  # this process's earlier harness runs
    hold = os.environ.get("FLEET_HOLD", os.devnull)
    free = int(os.environ.get("FLEET_FREE", "0"))

    def held():
        if earlier < free:
            return False
        return os.environ.get("FLEET_HOLD_SELF") == "1" or any(
            os.path.exists(os.path.join(hold, n)) for n in (str(pid), "all")
        )

    while held():  # the test holds this harness in flight
        time.sleep(0.05)
    time.sleep(float(os.environ.get("FLEET_SLEEP", "0.05")))
    return 1.0
"""


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("model") / "base", corpus=training_corpus())


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "lightning_dagster.cli", *args]


def make_project(root: Path, n: int) -> Path:
    """A project whose harness only logs its run, sleeps `FLEET_SLEEP` and returns reward 1. While
    `$FLEET_HOLD/<its pid>` or `$FLEET_HOLD/all` exists, or always with `FLEET_HOLD_SELF=1`, it waits in flight
    instead, except in a process's first `FLEET_FREE` runs."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "fleet_agent.py").write_text(AGENT)
    rows = [{"task_id": f"t{i}", "family": "f", "split": "train"} for i in range(n)]
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "lightning-dagster.yaml").write_text(
        "name: fleet\nharness:\n  python: fleet_agent:solve\n  expected_spans: [reward]\n"
        "training:\n  attempt_timeout_s: 60\n  max_attempts: 3\ntasks:\n  path: tasks.jsonl\n  id_column: task_id\n"
        "  family_column: family\n  split_column: split\n"
    )
    return root


def child_env(project: Path, log: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join([os.getcwd(), str(project), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "FLEET_LOG": str(log), **extra}


def wait_held(store, log: Path, pid: int, free: int, timeout: float = 120) -> list:
    """Wait until process `pid`, started with `FLEET_HOLD_SELF=1 FLEET_FREE=free`, has begun a harness run
    beyond its free ones: that harness waits in flight for good, so its attempt is certainly still running
    when the caller kills the process, however slowly the caller gets there. The hold is set before the
    process starts, so it cannot miss the queue (holding it later once found the queue already drained on a
    loaded machine). Returns the process's running attempts."""
    deadline = time.monotonic() + timeout
    while True:
        started = (
            sum(line.endswith(f" {pid}") for line in log.read_text().splitlines()) if log.exists() else 0
        )
        if started > free:
            running = [a for a in store.list_attempts(state="running") if f"-{pid}-" in (a.worker_id or "")]
            if running:
                return running
        assert time.monotonic() < deadline, f"process {pid} started {started} harness runs, none held"
        time.sleep(0.1)


class Gateway:
    """`lightning-dagster gateway serve` over `store_url` in a child process, sharing the fleet's secret."""

    def __init__(self, directory: Path, store_url: str, model_dir: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = cli(
            "gateway", "serve", "--port", str(self.port), "--model", str(model_dir), "--store-url", store_url
        )
        cmd += ["--secret-file", secret_file(directory, SECRET), "--engine-threads", "1"]
        cmd += ["--admin-key-file", secret_file(directory, ADMIN, "admin"), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                httpx.get(f"{self.url}/admin/health", headers={"Authorization": f"Bearer {ADMIN}"})
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gateway did not start: {self.proc.stderr.read()}") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
