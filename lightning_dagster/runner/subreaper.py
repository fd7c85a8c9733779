"""The process a command harness runs under (`python -I -S subreaper.py STATUS_FD -- ARGV...`, standard
library only, so it starts in milliseconds): it starts the harness and, once it has ended, kills and reaps
every process it left behind, then exits as the harness did.

Why one per attempt: a helper that starts its own session (`setsid`, a daemon) is re-parented to the
nearest child subreaper (`PR_SET_CHILD_SUBREAPER`); as that for one attempt, "every descendant" is exactly
"every process of this attempt". The runner cannot be one: it runs many attempts, and an orphan does not
say which it came from. Where the kernel allows (`_unshare`), the harness is process 2 of a PID namespace
whose init this process forks first, so the kernel kills all left in it when this process ends (with the
runner: setpriv's PR_SET_PDEATHSIG). Without it, only a process that leaves this tree on purpose escapes.

Protocol: STATUS_FD gets `cannot start ...` if the harness cannot start (exit 127), and is closed once it
has. SIGTERM stops the attempt (the harness's group is killed, then the sweep). The exit status is the
harness's: its code, or the signal that ended it.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CLONE_NEWUSER, CLONE_NEWPID = 0x10000000, 0x20000000
SWEEP_S = 10.0  # how long the sweep keeps killing before giving up (a process stuck in the kernel)


try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - no C library to load
    _LIBC = None


def _prctl(option: int, value: int) -> bool:
    prctl = getattr(_LIBC, "prctl", None)  # Linux only
    return prctl is not None and prctl(option, value, 0, 0, 0) == 0


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process in /proc (`/proc/PID/task/*/children` needs a kernel option)."""
    table: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): only the harness's process group is killed
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may itself hold spaces and parentheses
        table[int(name)] = int(stat.rsplit(b")", 1)[1].split()[1])
    return table


def descendants(pid: int) -> list[int]:
    """Every live or zombie descendant of `pid`, parents before their children."""
    children: dict[int, list[int]] = {}
    for child, parent in _parents().items():
        children.setdefault(parent, []).append(child)
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), ()):
            found.append(child)
            queue.append(child)
    return found


def _unshare() -> bool:
    """Put our next children in a new PID namespace (in a new user namespace if need be); False if refused."""
    unshare = getattr(_LIBC, "unshare", None)
    if unshare is None or unshare(CLONE_NEWPID) == 0:
        return unshare is not None
    uid, gid = os.getuid(), os.getgid()
    if unshare(CLONE_NEWUSER | CLONE_NEWPID) != 0:
        return False
    for name, line in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as fh:
            fh.write(line)
    return True


def _start_init(status_fd: int) -> None:
    """Fork process 1 of the new PID namespace: it reaps orphans and exits at end-of-file on a pipe only
    this process holds, so at our end (it holds no pipe of the runner's, whose ends the runner awaits)."""
    alive_r, alive_w = os.pipe()
    if os.fork() == 0:
        for fd in (alive_w, status_fd, 0, 1, 2):
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        os.read(alive_r, 1)
        os._exit(0)
    os.close(alive_r)


def sweep(deadline: float) -> None:
    """Kill and reap every descendant, in rounds until no child is left (orphans are re-parented here)."""
    me = os.getpid()
    while True:
        for pid in descendants(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # already gone, or not ours to signal
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # no child, live or zombie, is left
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _start(command: list[str], parent: int) -> int:
    """Fork and exec the harness in its own session (not `subprocess`: importing it doubles start-up)."""
    errors_r, errors_w = os.pipe()  # close-on-exec: the end of it tells the exec happened
    pid = os.fork()
    if pid == 0:
        try:
            os.close(errors_r)
            os.setsid()
            # SIGKILL when this process ends, and no start at all if it already has
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; a program expects the defaults
                if hasattr(signal, name):
                    signal.signal(getattr(signal, name), signal.SIG_DFL)
            os.execvp(command[0], command)
        except BaseException as exc:  # noqa: BLE001 - whatever it is, the parent reports it
            os.write(errors_w, str(exc).encode())
        finally:
            os._exit(127)
    os.close(errors_w)
    with os.fdopen(errors_r, "rb") as errors:
        error = errors.read().decode("utf-8", "replace")
    if error:
        os.waitpid(pid, 0)
        raise OSError(error)
    return pid


def _exit_as(status: int) -> None:
    if status >= 0:
        os._exit(status)
    signum = -status
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the harness may have dumped core; we need not
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (OSError, ValueError):  # SIGKILL's cannot be set (nor needs to be)
        pass
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end a process


def main(argv: list[str]) -> None:
    status_fd, separator, *command = argv
    if separator != "--" or not command:
        sys.exit("usage: subreaper.py STATUS_FD -- ARGV...")
    status_fd_ = int(status_fd)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)  # without it (not Linux) only the process group is killed
    me = os.getpid()
    started: list[int] = []  # the harness's pid, which is also its process group's id
    stopping: list[bool] = []

    def stop(signum: int, frame: object) -> None:
        stopping.append(True)
        for pgid in started:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:  # the group is empty already
                pass

    signal.signal(signal.SIGTERM, stop)  # a handler, not an ignore: the harness's exec resets it
    os.set_inheritable(status_fd_, False)  # the harness must not hold it: the runner reads it to its end
    namespaced = _unshare()
    if namespaced:
        _start_init(status_fd_)
    try:  # in a namespace, the harness's parent is outside it: getppid() is 0
        harness = _start(command, 0 if namespaced else me)
    except OSError as exc:
        os.write(status_fd_, f"cannot start {command[0]!r}: {exc}".encode())
        os._exit(127)
    os.close(status_fd_)
    started.append(harness)
    if stopping:  # stopped while it was starting
        stop(signal.SIGTERM, None)
    status = os.waitstatus_to_exitcode(os.waitpid(harness, 0)[1])
    # The harness's group first (a helper that never left it dies at once), then every other descendant
    # (the namespace's init among them: killing it kills all in the namespace).
    stop(signal.SIGTERM, None)
    sweep(time.monotonic() + SWEEP_S)
    _exit_as(status)


if __name__ == "__main__":
    main(sys.argv[1:])
