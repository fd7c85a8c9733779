"""Gateway secrets the way the CLIs take them (files only this user can read), and a `gateway serve` started
from the command line with them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def secret_file(directory: Path, secret: str, name: str = "gateway.secret") -> str:
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    return str(path)


def gateway_args(gateway: Any, store: Any, directory: Path) -> list[str]:
    """The `rollouts run` options that point it at a running gateway: its URL, its secret file, the store."""
    return [
        "--gateway",
        gateway.url,
        "--secret-file",
        secret_file(directory, gateway.secret),
        "--store-url",
        store.url,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_upstream_cli(
    directory: Path, upstream_url: str, secret: str, admin: str
) -> tuple[subprocess.Popen, int]:
    """`lightning-dagster gateway serve --upstream` in a child process, its secrets in 0600 files; (process, port)."""
    port = free_port()
    cmd = [sys.executable, "-m", "lightning_dagster.cli", "gateway", "serve", "--port", str(port)]
    cmd += ["--upstream-url", upstream_url, "--store-url", f"sqlite:///{Path(directory) / 'cli.db'}"]
    cmd += [
        "--secret-file",
        secret_file(directory, secret),
        "--admin-key-file",
        secret_file(directory, admin, "admin"),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), port


def wait_healthy(proc: subprocess.Popen, url: str, admin: str) -> httpx.Response:
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.get(f"{url}/admin/health", headers={"Authorization": f"Bearer {admin}"})
        except httpx.HTTPError:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
