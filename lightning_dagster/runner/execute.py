"""Run one attempt of a harness, as a subprocess (scrubbed environment, optional bubblewrap sandbox, its
own subreaper, bounded output) or an in-process callable, under `supervise`'s deadline and heartbeats."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lightning_dagster.runner.output import DEFAULT_MAX_OUTPUT_BYTES, Capture, notices
from lightning_dagster.settings import UsageError
from lightning_dagster.store.errors import StoreLocked
from lightning_dagster.types import AttemptState

log = logging.getLogger(__name__)
TAIL_CHARS = 2000
SUBREAPER = Path(__file__).with_name("subreaper.py")  # the process each command harness runs under
STOP_S = 10.0  # how long a stopped harness's subreaper may take to end its processes before it is killed


@dataclass(frozen=True)
class Outcome:
    """How an attempt ended, before it is written to the store."""

    state: AttemptState
    reason_code: str
    reason_message: str = ""


# What a harness inherits: what a program needs to run, nothing that may carry a credential.
INHERITED_ENV = frozenset(
    {
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "TEMP", "TMP",
        "PYTHONPATH", "PYTHONHOME", "PYTHONUNBUFFERED", "PYTHONIOENCODING", "PYTHONDONTWRITEBYTECODE",
        "VIRTUAL_ENV", "LD_LIBRARY_PATH", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
    }
)  # fmt: skip
INHERITED_PREFIXES = ("LC_",)
# Never passed, even when named: the project's own settings and secrets, and MLflow's credentials.
FORBIDDEN_PREFIXES = ("LD_", "MLFLOW_")
Sandbox = Literal["none", "bwrap"]
SANDBOXES = ("none", "bwrap")
# An attempt ends with the runner thread that started it (a SIGKILLed runner leaves no process posting into
# attempts another reaper ended): setpriv's PR_SET_PDEATHSIG sends its subreaper SIGTERM.
_SETPRIV = shutil.which("setpriv")
DIE_WITH_RUNNER = (_SETPRIV, "--pdeathsig", "TERM", "--") if _SETPRIV else ()
BWRAP = ("bwrap", "--dev-bind", "/", "/", "--unshare-pid", "--proc", "/proc")  # a PID namespace of its own


class SandboxUnavailable(RuntimeError, UsageError):
    """`sandbox="bwrap"` asked for on a machine where bubblewrap is missing or cannot run."""


def check_sandbox(sandbox: str) -> None:
    """ValueError for an unknown sandbox; `SandboxUnavailable` when `bwrap` is missing or cannot run."""
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {', '.join(SANDBOXES)}, got {sandbox!r}")
    if sandbox == "none":
        return
    if shutil.which(BWRAP[0]) is None:
        raise SandboxUnavailable("sandbox 'bwrap' needs bubblewrap (Debian: apt-get install bubblewrap)")
    trial = subprocess.run([*BWRAP, "--", "true"], capture_output=True, text=True, timeout=30)
    if trial.returncode != 0:
        raise SandboxUnavailable(f"bwrap cannot make a PID namespace here: {trial.stderr.strip()}")


def check_passthrough(names: Sequence[str]) -> tuple[str, ...]:
    """The extra variable names a harness may inherit; `LD_*` and `MLFLOW_*` raise ValueError."""
    refused = [n for n in names if n.startswith(FORBIDDEN_PREFIXES) and n != "LD_LIBRARY_PATH"]
    if refused:
        raise ValueError(
            f"{', '.join(refused)}: LD_* and MLFLOW_* variables carry the project's settings and credentials "
            "and are never passed to a harness"
        )
    return tuple(names)


def child_env(env: dict[str, str], passthrough: Sequence[str] = ()) -> dict[str, str]:
    """The allowlisted part of our environment plus the attempt's (its key: the whole write surface)."""
    keep = INHERITED_ENV.union(passthrough)
    inherited = {k: v for k, v in os.environ.items() if k in keep or k.startswith(INHERITED_PREFIXES)}
    return {**inherited, **env}


def sandboxed(
    argv: list[str], sandbox: Sandbox, *, hide: Sequence[Path], expose: Sequence[Path]
) -> list[str]:
    """`argv` wrapped for `sandbox` (`bwrap`: no other process visible, `hide` folders but `expose` empty)."""
    if sandbox == "none":
        return argv
    wrapped = [*BWRAP, "--die-with-parent"]
    for path in hide:
        if path.is_dir():
            wrapped += ["--tmpfs", str(path)]
    for path in expose:
        wrapped += ["--bind", str(path), str(path)]
    return [*wrapped, "--", *argv]


# Linux refuses to exec with an environment string ("NAME=value\0") over MAX_ARG_STRLEN, 32 pages of 4 KiB
# (E2BIG): a task whose JSON does not fit is left out of AGL_TASK and LD_TASK, for LD_TASK_FILE.
MAX_ENV_STRING = 32 * 4096
TASK_FILE = "task.json"  # in the attempt's workdir: the task as JSON, named by LD_TASK_FILE


def fits_env(name: str, value: str) -> bool:
    """Whether `name=value` is an environment string Linux lets a program start with."""
    return len(name.encode()) + len(value.encode()) + 2 <= MAX_ENV_STRING


def write_task_file(workdir: Path, task_json: str) -> Path:
    """The task written to the attempt's `task.json` (its absolute path, for `LD_TASK_FILE`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = (workdir / TASK_FILE).resolve()
    path.write_text(task_json, encoding="utf-8")
    return path


def harness_env(
    gateway_url: str,
    key: str,
    rollout_id: str,
    attempt_id: str,
    task_json: str,
    *,
    task_file: Path | None = None,
) -> dict[str, str]:
    """The Agent Lightning environment a harness reads (CONTRACTS.md), the task also in `LD_TASK*`."""
    base = f"{gateway_url}/v1"
    env = {
        "OPENAI_BASE_URL": base,
        "AGL_OPENAI_BASE_URL": base,
        "OPENAI_API_KEY": key,
        "AGL_KEY": key,
        "AGL_EVENT_URL": f"{gateway_url}/v1/events",
        "AGL_ROLLOUT_ID": rollout_id,
        "AGL_ATTEMPT_ID": attempt_id,
    }
    if fits_env("AGL_TASK", task_json):
        env["AGL_TASK"] = env["LD_TASK"] = task_json
    if task_file is not None:
        env["LD_TASK_FILE"] = str(task_file)
    return env


def task_note(env: dict[str, str], task_json: str) -> str:
    """Why a subprocess's task is not in `LD_TASK` / `AGL_TASK` ("" when it is, or runs in process)."""
    if "LD_TASK" in env or "LD_TASK_FILE" not in env:
        return ""
    size = len(task_json.encode())
    return (
        f"the task is {size} bytes of JSON, more than the {MAX_ENV_STRING // 1024} KiB Linux allows one "
        "environment variable: AGL_TASK and LD_TASK were left out, the task is in the file LD_TASK_FILE "
        "names (and on standard input)"
    )


def supervise(
    wait: Callable[[float], bool],
    stop: Callable[[], None],
    *,
    timeout_s: float,
    heartbeat_interval_s: float,
    heartbeat: Callable[[], bool],
) -> str | None:
    """Wait for the harness (`wait(seconds)`: True once done), heartbeating (`heartbeat()`: False once not
    ours): None, or `"timeout"` / `"superseded"` after `stop()`. The start stamped the first beat."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if wait(max(0.0, min(heartbeat_interval_s, left))):
                return None
            if time.monotonic() >= deadline:
                stop()
                return "timeout"
            try:
                ours = heartbeat()
            except Exception as err:  # noqa: BLE001 - a missed beat is transient; the reaper judges a run of them
                # a store locked by other writers is the usual cause: one line; anything else with its trace
                log.warning("heartbeat failed: %s", err, exc_info=not isinstance(err, StoreLocked))
                ours = True
            if not ours:
                stop()
                return "superseded"
    except BaseException:
        stop()  # never leave a harness running unsupervised (KeyboardInterrupt included)
        raise


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - TAIL_CHARS))
            return fh.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _tails(workdir: Path) -> str:
    parts = [f"{name} tail:\n{text}" for name in ("stderr", "stdout") if (text := _tail(workdir / name))]
    return ("\n" + "\n".join(parts)) if parts else ""


def run_subprocess(
    argv: list[str],
    env: dict[str, str],
    workdir: Path,
    supervise_kw: dict[str, Any],
    *,
    cwd: Path | None = None,
    passthrough: Sequence[str] = (),
    sandbox: Sandbox = "none",
    hide: Sequence[Path] = (),
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> tuple[Outcome | None, str | None, str]:
    """Run the harness command in `cwd` with a scrubbed environment under `subreaper.py`, the task on stdin
    from a file (a harness that never reads it cannot block us); (failure or None, verdict, cut notice)."""
    workdir.mkdir(parents=True, exist_ok=True)
    task_in_path = Path(env["LD_TASK_FILE"]) if "LD_TASK_FILE" in env else workdir / "stdin"
    if "LD_TASK_FILE" not in env:
        task_in_path.write_text(env["LD_TASK"])
    expose = [workdir.resolve()] + ([Path(cwd).resolve()] if cwd is not None else [])
    status_r, status_w = os.pipe()
    command = [
        *DIE_WITH_RUNNER, sys.executable, "-I", "-S", str(SUBREAPER), str(status_w), "--",
        *sandboxed(argv, sandbox, hide=hide, expose=expose),
    ]  # fmt: skip
    try:
        with task_in_path.open("rb") as task_in:
            proc = subprocess.Popen(
                command, env=child_env(env, passthrough), stdin=task_in, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, cwd=cwd, start_new_session=True, pass_fds=(status_w,),
            )  # fmt: skip
    except OSError as exc:
        os.close(status_r)
        return Outcome(AttemptState.failed, "spawn_error", f"cannot start {argv[0]!r}: {exc}"), None, ""
    finally:
        os.close(status_w)
    assert proc.stdout is not None and proc.stderr is not None
    capture = Capture({"stdout": proc.stdout, "stderr": proc.stderr}, workdir, max_output_bytes)
    with os.fdopen(status_r, "rb") as status:
        spawn_error = status.read().decode("utf-8", "replace")  # closed once the harness has started
    if spawn_error:
        proc.wait()
        capture.close()
        return Outcome(AttemptState.failed, "spawn_error", spawn_error), None, ""

    def kill_group() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # the group is empty (or its id reused)
            pass

    def kill() -> None:
        # The subreaper kills the harness's tree and exits; killing its group is the fallback if it does not.
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            kill_group()
            proc.wait()

    def wait(seconds: float) -> bool:
        try:
            proc.wait(seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    try:
        verdict = supervise(wait, kill, **supervise_kw)
    finally:
        kill_group()  # whatever is left in the subreaper's own group (nothing, unless it was killed)
        notice = notices(capture.close())
    if verdict == "timeout":
        message = f"harness killed after the {supervise_kw['timeout_s']:g}s timeout{_tails(workdir)}"
        return Outcome(AttemptState.timeout, "timeout", message), verdict, notice
    if verdict is not None:
        return None, verdict, notice
    code = proc.returncode
    if code == 0:
        return None, None, notice
    if code < 0:  # ended by a signal: -code is its number
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        reason, what = "killed", f"harness killed by {name}"
    else:
        reason, what = "exit_nonzero", f"harness exited with status {code}"
    return Outcome(AttemptState.failed, reason, what + _tails(workdir)), None, notice


def run_inprocess(
    run_task: Callable[..., float], task: dict[str, Any], env: dict[str, str], supervise_kw: dict[str, Any]
) -> tuple[Outcome | None, str | None]:
    """Call `run_task` in a thread, abandoned after a timeout (what it still sends is refused downstream)."""
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["reward"] = run_task(
                task,
                base_url=env["OPENAI_BASE_URL"],
                api_key=env["OPENAI_API_KEY"],
                event_url=env["AGL_EVENT_URL"],
            )
        except BaseException as exc:  # noqa: BLE001 - everything a harness raises is its attempt's failure
            result["error"] = "".join(traceback.format_exception(exc))[-TAIL_CHARS:]

    thread = threading.Thread(target=target, name=f"harness-{env['AGL_ATTEMPT_ID']}", daemon=True)
    thread.start()

    def wait(seconds: float) -> bool:
        thread.join(seconds)
        return not thread.is_alive()

    verdict = supervise(wait, lambda: None, **supervise_kw)
    if verdict == "timeout":
        message = (
            f"in-process harness still running after the {supervise_kw['timeout_s']:g}s timeout (abandoned)"
        )
        return Outcome(AttemptState.timeout, "timeout", message), verdict
    if verdict is not None:
        return None, verdict
    if "error" in result:
        return Outcome(AttemptState.failed, "exception", result["error"]), None
    return None, None
