"""The process a command harness runs under: it starts the harness and, once the harness has ended, kills
and reaps every process the harness left behind, then exits as the harness did. Run by path with the
standard library only (`python -I -S subreaper.py STATUS_FD -- ARGV...`), so it starts in milliseconds.

Why a process of its own per attempt: a helper that starts a session of its own (`setsid`, a double-forked
daemon) leaves the harness's process group, and is re-parented to the nearest child subreaper
(`PR_SET_CHILD_SUBREAPER`). As that subreaper for exactly one attempt, "every descendant of this process" is
exactly "every process of this attempt". The runner is never one: it runs many attempts at once, an orphan
carries nothing that says which attempt it came from, and it must not steal another child's exit status.

Where the kernel allows (`_unshare`), the harness runs as process 2 of a PID namespace of its own, whose
init this process forks first and which ends when this process does, however it ends: the kernel then kills
every process left in it. This process ends with the runner (SIGTERM: setpriv's PR_SET_PDEATHSIG). Without
the namespace, only a process that leaves this tree on purpose escapes (one that kills this process first,
or asks a service outside it to start something).

Protocol with the runner: STATUS_FD gets `cannot start ...` if the harness cannot be started (then exit
127), and is closed once it has started. SIGTERM stops the attempt: the harness's process group is killed,
then the sweep. The exit status is the harness's: its code, or the same signal that ended it.
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
    """Put this process's next children in a new PID namespace: with CAP_SYS_ADMIN, or else in a new user
    namespace mapping our user and group to themselves. False when the kernel refuses both (user namespaces
    forbidden, as in many containers) or this is not Linux: then the harness runs in ours."""
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
    """Fork process 1 of the new PID namespace. It reaps the orphans it adopts (SIGCHLD ignored) and exits
    once it reads end-of-file on a pipe only this process holds open (close-on-exec), so at our end. It
    holds no pipe of the runner's: their ends tell the runner the harness started, and its output ended."""
    alive_r, alive_w = os.pipe()
    if os.fork() == 0:
        for fd in (alive_w, status_fd, 0, 1, 2):
            os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        os.read(alive_r, 1)
        os._exit(0)
    os.close(alive_r)


def sweep(deadline: float) -> None:
    """Kill every descendant of this process and reap them all. A killed process's children are re-parented
    here (we are their subreaper), so rounds go on until this process has no child left at all."""
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
    """Fork and exec the harness in a session of its own; its pid, or OSError saying why it cannot start.
    (Not `subprocess`: importing it would double this process's start-up.)"""
    errors_r, errors_w = os.pipe()  # close-on-exec: the end of it tells the exec happened
    pid = os.fork()
    if pid == 0:
        try:
            os.close(errors_r)
            os.setsid()
            # SIGKILL when this process ends (the runner's thread ending kills this process the same way),
            # and no start at all if it already has.
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
