"""A real `mlflow server` for tests: PostgreSQL backend store, proxied artifacts in a temp dir, 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """Start, stop and restart (same port, same backend) an MLflow tracking server."""

    def __init__(self, backend_store_uri: str, artifacts: Path, log: Path) -> None:
        self.backend_store_uri = backend_store_uri
        self.artifacts = artifacts
        self.log = log
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> MlflowServer:
        mlflow_bin = Path(sys.executable).with_name("mlflow")
        cmd = [
            str(mlflow_bin),
            "server",
            "--backend-store-uri",
            self.backend_store_uri,
            "--artifacts-destination",
            str(self.artifacts),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "1"}
        # Its own session, so stop() can end the server and the workers it spawns as one group.
        self.proc = subprocess.Popen(
            cmd, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.log}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"mlflow server not healthy within {timeout}s; see {self.log}")

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=5)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:  # graceful shutdown waits on keep-alive clients; do not wait long
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        # The port must be closed before a test may call the server "stopped".
        deadline = time.time() + 10
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)
