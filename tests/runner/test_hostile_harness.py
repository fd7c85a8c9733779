"""Harness processes that misbehave, run by `run_subprocess` without a gateway: what they leave behind and
what their attempt records."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_dagster.runner.execute import run_subprocess
from lightning_dagster.runner.output import marker
from lightning_dagster.types import AttemptState

SUPERVISE = {"timeout_s": 20.0, "heartbeat_interval_s": 5.0, "heartbeat": lambda: True}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie waiting for init is gone


def _run(tmp_path: Path, script: str, workdir: str = "attempt", **kw) -> tuple:
    env = {"LD_TASK": json.dumps({"task_id": "t"})}
    kw = {"supervise_kw": SUPERVISE, "cwd": tmp_path, **kw}
    return _run_argv([sys.executable, "-c", script], env, tmp_path / workdir, **kw)


def _run_argv(argv: list[str], env: dict[str, str], workdir: Path, *, supervise_kw: dict, **kw) -> tuple:
    return run_subprocess(argv, env, workdir, supervise_kw, **kw)


def _gone(pid: int) -> bool:
    """No such process at all: neither running nor a zombie left unreaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _pid_from(path: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and path.read_text().strip()):
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.02)
    return int(path.read_text())


def _cleanup(*pids: int) -> None:
    for pid in pids:  # only when an assertion failed: leave nothing behind
        if not _gone(pid):
            os.kill(pid, signal.SIGKILL)


# Writes its pid on this machine to the file argv[1] names, then sleeps. Not getpid(): a harness runs in a
# PID namespace of its own where it can, and /proc (the machine's) says what the pid is outside it.
PID_WRITER = """
import os, sys, time
open(sys.argv[1] + ".tmp", "w").write(os.readlink("/proc/self"))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""
# A helper in a session of its own (setsid): it leaves the harness's process group.
SETSID_HELPER = f"""
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {PID_WRITER!r}, sys.argv[1]], start_new_session=True)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
"""
# A daemon the classic way: fork, setsid, fork again, the middle process exits; the harness does not wait.
DOUBLE_FORK = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(sys.argv[1] + ".tmp", "w").write(os.readlink("/proc/self"))
        os.rename(sys.argv[1] + ".tmp", sys.argv[1])
        time.sleep(600)
    os._exit(0)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
"""


def test_a_helper_the_harness_leaves_running_ends_with_its_attempt(tmp_path):
    script = (
        "import os, subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {PID_WRITER!r}, {str(tmp_path / 'pid')!r}])\n"
        f"while not os.path.exists({str(tmp_path / 'pid')!r}):\n    time.sleep(0.01)\n"
    )
    failure, verdict, cut = _run(tmp_path, script)
    assert (failure, verdict, cut) == (None, None, "")
    pid = int((tmp_path / "pid").read_text())
    try:
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
    finally:
        if _alive(pid):  # only when the assertion failed: leave nothing behind
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("helper", [SETSID_HELPER, DOUBLE_FORK], ids=["setsid", "double-fork"])
def test_a_helper_that_leaves_the_process_group_ends_with_its_attempt(tmp_path, helper):
    pid_file = tmp_path / "helper.pid"
    env = {"LD_TASK": "{}"}
    failure, verdict, _ = _run_argv(
        [sys.executable, "-c", helper, str(pid_file)], env, tmp_path / "attempt", supervise_kw=SUPERVISE
    )
    pid = _pid_from(pid_file)
    try:
        assert (failure, verdict) == (None, None)
        assert _gone(pid)  # killed and reaped by the time the attempt's run returns
    finally:
        _cleanup(pid)


def test_a_helper_in_its_own_session_ends_when_the_harness_is_stopped_at_its_timeout(tmp_path):
    pid_file = tmp_path / "helper.pid"
    script = SETSID_HELPER + "import time; time.sleep(600)\n"
    supervise_kw = {**SUPERVISE, "timeout_s": 1.0}
    started = time.monotonic()
    failure, verdict, _ = _run_argv(
        [sys.executable, "-c", script, str(pid_file)], {"LD_TASK": "{}"}, tmp_path / "attempt",
        supervise_kw=supervise_kw,
    )  # fmt: skip
    pid = _pid_from(pid_file)
    try:
        assert verdict == "timeout" and failure.state == AttemptState.timeout
        assert time.monotonic() - started < 10
        assert _gone(pid)
    finally:
        _cleanup(pid)


def test_concurrent_attempts_end_only_their_own_helpers(tmp_path):
    # Two attempts in one runner process: the first ends while the second still runs; the second's helper
    # (in a session of its own, as is the first's) must live until its own attempt ends.
    script = SETSID_HELPER + (
        "import os, time\nwhile not os.path.exists(sys.argv[2]):\n    time.sleep(0.02)\n"
    )
    go = {name: tmp_path / f"go-{name}" for name in "ab"}
    results: dict[str, tuple] = {}

    def attempt(name: str) -> None:
        argv = [sys.executable, "-c", script, str(tmp_path / f"{name}.pid"), str(go[name])]
        results[name] = _run_argv(argv, {"LD_TASK": "{}"}, tmp_path / name, supervise_kw=SUPERVISE)

    threads = {name: threading.Thread(target=attempt, args=(name,)) for name in "ab"}
    for thread in threads.values():
        thread.start()
    pids = {name: _pid_from(tmp_path / f"{name}.pid") for name in "ab"}
    try:
        go["a"].touch()
        threads["a"].join(20)
        assert results["a"][:2] == (None, None) and _gone(pids["a"])
        assert not _gone(pids["b"])  # the other attempt's helper is untouched while it runs
        time.sleep(0.3)
        assert not _gone(pids["b"]) and threads["b"].is_alive()
        go["b"].touch()
        threads["b"].join(20)
        assert results["b"][:2] == (None, None) and _gone(pids["b"])
    finally:
        for name in "ab":
            go[name].touch()
        _cleanup(*pids.values())


def test_a_program_that_cannot_start_fails_the_attempt_with_spawn_error(tmp_path):
    failure, verdict, cut = _run_argv(
        [str(tmp_path / "no-such-program")], {"LD_TASK": "{}"}, tmp_path / "attempt", supervise_kw=SUPERVISE
    )
    assert failure.state == AttemptState.failed and failure.reason_code == "spawn_error"
    assert failure.reason_message.startswith(f"cannot start {str(tmp_path / 'no-such-program')!r}")
    assert (verdict, cut) == (None, "")


def test_a_harness_that_prints_far_past_the_cap_finishes_and_keeps_its_head_and_tail(tmp_path):
    # 50 MB of `yes` between a first and a last line, on stdout, and a short stderr.
    total = 50_000_000
    script = f"echo FIRST; yes | head -c {total}; echo LAST; echo a warning >&2"
    cap = 64 * 1024
    started = time.monotonic()
    failure, verdict, cut = _run_argv(
        ["sh", "-c", script], {"LD_TASK": "{}"}, tmp_path / "attempt", supervise_kw=SUPERVISE,
        max_output_bytes=cap,
    )  # fmt: skip
    assert time.monotonic() - started < 15
    assert (failure, verdict) == (None, None)
    printed = len("FIRST\n") + total + len("LAST\n")
    dropped = printed - cap
    kept = (tmp_path / "attempt" / "stdout").read_bytes()
    mark = marker("stdout", dropped, cap)
    assert len(kept) == cap + len(mark)
    head, tail = kept[: cap // 2], kept[cap // 2 + len(mark) :]
    assert head.startswith(b"FIRST\ny\ny\n") and tail.endswith(b"y\ny\nLAST\n")
    assert kept[cap // 2 : cap // 2 + len(mark)] == mark
    assert f"{dropped:,} bytes of stdout dropped here" in mark.decode()
    assert (tmp_path / "attempt" / "stderr").read_bytes() == b"a warning\n"  # under the cap: whole
    assert cut == f"stdout truncated: {printed:,} bytes printed, {dropped:,} dropped from the middle"


def _interleaved(lines: int) -> str:
    return (
        "import sys\n"
        f"for i in range({lines}):\n"
        "    print(f'out {i}', flush=True)\n"
        "    print(f'err {i}', file=sys.stderr, flush=True)\n"
    )


def test_interleaved_stdout_and_stderr_under_the_cap_are_kept_whole(tmp_path):
    failure, verdict, cut = _run(tmp_path, _interleaved(3000), max_output_bytes=1024 * 1024)
    assert (failure, verdict, cut) == (None, None, "")
    for name in ("out", "err"):
        expected = "".join(f"{name} {i}\n" for i in range(3000))
        assert (tmp_path / "attempt" / f"std{name}").read_text() == expected


def test_interleaved_stdout_and_stderr_past_the_cap_are_each_cut_on_their_own(tmp_path):
    lines, cap = 20000, 4096
    failure, verdict, cut = _run(tmp_path, _interleaved(lines), max_output_bytes=cap)
    assert (failure, verdict) == (None, None)
    for name in ("out", "err"):
        full = "".join(f"{name} {i}\n" for i in range(lines)).encode()
        kept = (tmp_path / "attempt" / f"std{name}").read_bytes()
        mark = marker(f"std{name}", len(full) - cap, cap)
        assert kept == full[: cap // 2] + mark + full[-(cap // 2) :]
        assert re.search(rf"std{name} truncated: {len(full):,} bytes printed", cut)


def test_a_failed_harness_past_the_cap_reports_its_real_last_lines(tmp_path):
    script = "import sys\nfor i in range(100000): print('noise', i)\nsys.exit('the real error')\n"
    failure, _, cut = _run(tmp_path, script, max_output_bytes=4096)
    assert failure.reason_code == "exit_nonzero" and "the real error" in failure.reason_message
    assert "noise 99999" in failure.reason_message and cut.startswith("stdout truncated")


@pytest.mark.parametrize(
    ("script", "reason", "fragment"),
    [
        ("import sys; sys.exit(3)", "exit_nonzero", "harness exited with status 3"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed", "harness killed by SIGKILL"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "killed", "harness killed by SIGSEGV"),
    ],
)
def test_the_attempt_ends_as_the_harness_did_not_as_the_process_it_runs_under(
    tmp_path, script, reason, fragment
):
    failure, verdict, _ = _run(tmp_path, script)
    assert failure.reason_code == reason and failure.reason_message.startswith(fragment)
    assert verdict is None
