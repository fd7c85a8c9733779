"""Start a throwaway PostgreSQL 15 server on 127.0.0.1 in a temp dir, for tests that need a real one."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb refuses to run as root; the machine has a `postgres` user for this.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def _pg_bin(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
        return str(candidate)
    raise RuntimeError(f"PostgreSQL binary {name!r} not found; install postgresql-15")


class PostgresServer:
    """A running server; `url(dbname)` gives a psycopg2 SQLAlchemy URL, `create_database()` a fresh one."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="ld-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user = "postgres"
        self._started = False

    def start(self) -> PostgresServer:
        os.chmod(self.root, 0o777)
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres", "postgres")
        subprocess.run(
            _as_postgres(
                [_pg_bin("initdb"), "-D", str(self.data), "-U", self.user, "-A", "trust", "-E", "UTF8"]
            ),
            check=True,
            capture_output=True,
        )
        subprocess.run(
            _as_postgres(
                [
                    _pg_bin("pg_ctl"),
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.root / "server.log"),
                    "-o",
                    f"-h 127.0.0.1 -p {self.port} -k {self.root} -c max_connections=200 -c fsync=off",
                    "-w",
                    "start",
                ]
            ),
            check=True,
            capture_output=True,
        )
        self._started = True
        return self

    def psql(self, sql: str, dbname: str = "postgres") -> None:
        subprocess.run(
            [
                "psql",
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                self.user,
                "-d",
                dbname,
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ],
            check=True,
            capture_output=True,
        )

    def create_database(self, prefix: str = "t") -> str:
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        self.psql(f"CREATE DATABASE {name}")
        return name

    def url(self, dbname: str = "postgres", driver: str = "postgresql+psycopg2") -> str:
        return f"{driver}://{self.user}@127.0.0.1:{self.port}/{dbname}"

    def stop(self) -> None:
        if self._started:
            subprocess.run(
                _as_postgres([_pg_bin("pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]),
                capture_output=True,
            )
            self._started = False
        shutil.rmtree(self.root, ignore_errors=True)


def wait_port(host: str, port: int, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} did not open within {timeout}s")
