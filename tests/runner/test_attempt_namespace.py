"""No process of an attempt outlives it when the runner process itself is killed with SIGKILL: each attempt
runs in a PID namespace of its own, whose init ends with the attempt's subreaper. Where the kernel refuses
the namespace (here: an unmapped user namespace), the subreaper alone ends them when the runner dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lightning_dagster.runner.execute import SUBREAPER, run_subprocess

# Writes "<getpid> <pid as /proc sees it>" for itself, a helper in a session of its own and a double-forked
# daemon, each to its own file, then waits to be killed. Every process gets the test's directory as argv[1].
NOTE = """
import os, sys, time
def note(name):
    path = os.path.join(sys.argv[1], name)
    open(path + ".tmp", "w").write(f"{os.getpid()} {os.readlink('/proc/self')}")
    os.rename(path + ".tmp", path)
"""
HARNESS = (
    NOTE
    + """
import subprocess
note("harness")
subprocess.Popen([sys.executable, "-c", SETSID_HELPER, sys.argv[1]], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        note("daemon")
        time.sleep(600)
    os._exit(0)
time.sleep(600)
""".replace("SETSID_HELPER", repr(NOTE + "note('setsid')\ntime.sleep(600)\n"))
)
NAMES = ("harness", "setsid", "daemon")

# The runner, in a process of its own so the test can kill it: one rollout of HARNESS from a SQLite store.
DRIVER = """
import sys
from pathlib import Path
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.store import Store
tmp, harness = Path(sys.argv[1]), sys.argv[2]
store = Store(f"sqlite:///{tmp / 'store.db'}")
spec = HarnessSpec(name="lingerer", expected_span_families=(), argv=(sys.executable, "-c", harness, str(tmp)))
(rollout,) = enqueue_tasks(store, spec, [{"task_id": "t", "family": "f"}], kind="train")
Runner(store, "http://127.0.0.1:9", secret="s", harness=spec, workdir=tmp / "attempts",
       policy=RetryPolicy(timeout_s=120, max_attempts=1)).run([rollout.rollout_id])
"""


def _alive_naming(token: str) -> set[int]:
    """Pids of live processes (not zombies) whose command line holds `token`."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if token.encode() in cmdline and state != "Z":
            found.add(int(name))
    return found


def _notes(tmp: Path, timeout_s: float = 30.0) -> dict[str, tuple[int, int]]:
    """name -> (pid the process saw, its pid on this machine), once every process has written its note."""
    deadline = time.monotonic() + timeout_s
    while not all((tmp / name).exists() for name in NAMES):
        assert time.monotonic() < deadline, f"notes never written: {sorted(os.listdir(tmp))}"
        time.sleep(0.05)
    return {name: tuple(map(int, (tmp / name).read_text().split())) for name in NAMES}


def _survivors(token: str) -> set[int]:
    """The processes naming `token` still alive after up to 10 s (then killed: leave nothing behind)."""
    deadline = time.monotonic() + 10
    while (alive := _alive_naming(token)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # it just ended
            pass
    return alive


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _refusal(wrap: tuple[str, ...] = ()) -> str | None:
    """Why a process run under `wrap` can make no PID namespace, as root or in a user namespace of its own
    (None: it can, and so can an attempt's subreaper run that way)."""
    for command in (("unshare", "--pid", "true"), ("unshare", "--user", "--pid", "true")):
        run = subprocess.run([*wrap, *command], capture_output=True, text=True)
        if run.returncode == 0:
            return None
    return run.stderr.strip()


def _kill_runner_mid_attempt(tmp: Path, wrap: tuple[str, ...] = ()) -> tuple[dict, set[int], set[int]]:
    """Start DRIVER (under `wrap`), SIGKILL it once every process of the attempt is up; returns the notes,
    the attempt's processes before the kill and those still alive 10 s after it."""
    token = str(tmp)
    driver = subprocess.Popen([*wrap, sys.executable, "-c", DRIVER, token, HARNESS])
    try:
        notes = _notes(tmp)
        before = _alive_naming(token)
    finally:
        driver.kill()
        driver.wait()
    return notes, before, _survivors(token)


def test_no_process_of_an_attempt_survives_a_sigkill_of_the_runner(tmp_path):
    if why := _refusal():
        pytest.skip(f"no PID namespace here: {why}")
    notes, before, after = _kill_runner_mid_attempt(tmp_path)
    assert {real for _, real in notes.values()} <= before
    assert after == set()
    # Each saw itself in a namespace of its own: the harness is the second process there, after its init.
    assert notes["harness"][0] == 2 and all(seen != real for seen, real in notes.values())


def test_without_a_namespace_the_attempts_processes_still_end_with_a_killed_runner(tmp_path):
    # In a user namespace that maps no user, the kernel refuses a PID namespace, as in many containers.
    if _refusal(("unshare", "--user")) is None:
        pytest.skip("an unmapped user namespace can still make a PID namespace here")
    notes, before, after = _kill_runner_mid_attempt(tmp_path, ("unshare", "--user"))
    assert all(seen == real for seen, real in notes.values())  # no namespace: pids are the machine's
    assert {real for _, real in notes.values()} <= before and after == set()


def test_no_process_of_an_attempt_survives_its_subreaper_killed(tmp_path):
    # What the harness cannot do (the subreaper is outside its namespace), and the OOM killer can.
    if why := _refusal():
        pytest.skip(f"no PID namespace here: {why}")
    argv = [sys.executable, "-c", HARNESS, str(tmp_path)]
    supervise_kw = {"timeout_s": 60.0, "heartbeat_interval_s": 5.0, "heartbeat": lambda: True}
    result: list = []
    attempt = threading.Thread(
        target=lambda: result.append(
            run_subprocess(argv, {"LD_TASK": "{}"}, tmp_path / "attempt", supervise_kw)
        )
    )
    attempt.start()
    try:
        notes = _notes(tmp_path)
        # The subreaper is our child; its namespace's init, its child, has the same command line.
        ours = _alive_naming(str(tmp_path)) & _alive_naming(str(SUBREAPER))
        subreaper = [pid for pid in ours if _parent(pid) == os.getpid()]
        assert len(subreaper) == 1
        os.kill(subreaper[0], signal.SIGKILL)
        attempt.join(30)
    finally:
        after = _survivors(str(tmp_path))
    assert after == set() and not attempt.is_alive()
    failure, verdict, _ = result[0]
    assert failure.reason_code == "killed" and verdict is None and notes["harness"][0] == 2


def test_without_cap_sys_admin_the_attempt_gets_a_user_namespace_mapping_its_own_ids():
    if os.geteuid() != 0:
        pytest.skip("needs root to run as another user (any other user's attempts take this path above)")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if why := _refusal(tuple(nobody)):
        pytest.skip(f"user namespaces are refused here: {why}")
    status_r, status_w = os.pipe()
    try:
        run = subprocess.run(
            [*nobody, sys.executable, "-I", "-S", str(SUBREAPER), str(status_w), "--",
             "sh", "-c", "echo $$ $(id -u) $(id -g) $(cat /proc/self/uid_map)"],
            pass_fds=(status_w,), capture_output=True, text=True, cwd="/", timeout=30,
        )  # fmt: skip
    finally:
        os.close(status_w)
        os.close(status_r)
    # Process 2 of a PID namespace, still user and group 65534, which the user namespace maps to themselves.
    assert (run.returncode, run.stdout.split()) == (0, ["2", "65534", "65534", "65534", "65534", "1"])
