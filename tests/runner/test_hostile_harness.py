"""Harness processes that misbehave, run by `run_subprocess` without a gateway: what they leave behind and
what their attempt records."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from lightning_dagster.runner.execute import run_subprocess

SUPERVISE = {"timeout_s": 20.0, "heartbeat_interval_s": 5.0, "heartbeat": lambda: True}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waiting for init is gone


def _run(tmp_path: Path, script: str) -> tuple:
    env = {"LD_TASK": json.dumps({"task_id": "t"})}
    return run_subprocess([sys.executable, "-c", script], env, tmp_path / "attempt", SUPERVISE, cwd=tmp_path)


def test_a_helper_the_harness_leaves_running_ends_with_its_attempt(tmp_path):
    script = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(child.pid))\n"
    )
    failure, verdict = _run(tmp_path, script)
    assert (failure, verdict) == (None, None)
    pid = int((tmp_path / "pid").read_text())
    try:
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):  # only when the assertion failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)
