"""Shared fixtures: a real PostgreSQL server for the session, a fresh database per test."""

from __future__ import annotations

import os

import pytest

from tests.support.postgres import PostgresServer

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def postgres_server():
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A SQLAlchemy URL (postgresql+psycopg2) to a new, empty database on the session's server."""
    return postgres_server.url(postgres_server.create_database())


# A session whose tests have all reported must end: a thread or child process a failing test left behind
# (a non-daemon thread joined at interpreter exit, a multiprocessing child) would otherwise hold the
# process, and CI would show only its time running out. After LD_TEST_EXIT_GRACE_S seconds the watchdog
# prints every thread's stack and the live children (what to fix), then ends the process with pytest's
# exit status.
EXIT_GRACE_S = float(os.environ.get("LD_TEST_EXIT_GRACE_S", "120"))


def _exit_watchdog(status: int) -> None:
    import faulthandler
    import sys
    import threading
    import time

    time.sleep(EXIT_GRACE_S)
    print(f"\n[exit watchdog] pytest had not exited {EXIT_GRACE_S:.0f} s after its summary:", file=sys.stderr)
    for thread in threading.enumerate():
        print(f"[exit watchdog] thread {thread.name!r} daemon={thread.daemon}", file=sys.stderr)
    try:
        children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
        for pid in children:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            print(f"[exit watchdog] child {pid}: {cmd[:300]}", file=sys.stderr)
    except OSError:
        pass
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    os._exit(status)


def pytest_sessionfinish(session, exitstatus):
    import threading

    threading.Thread(target=_exit_watchdog, args=(int(exitstatus),), name="exit-watchdog", daemon=True).start()
