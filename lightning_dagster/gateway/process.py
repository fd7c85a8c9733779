"""The gateway and its engine in a process of their own, started and fed weights by a trainer.

Why a process: in the trainer's process the decode loop shares one interpreter lock with the harness workers
and the HTTP server, which starves it (benchmarks/README.md, training). Weights travel as a safetensors file
(`POST /admin/weights` with its path), never as tensors over HTTP; the push returns once they are served.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_dagster.gateway.keys import SECRET_ENV_NAMES, GatewayKeys
from lightning_dagster.gateway.options import GatewayOptions

PORT_ATTEMPTS = 3


class GatewayProcessError(RuntimeError):
    """The gateway process did not start, died, or refused a request; the message carries its log tail."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GatewayProcess:
    """`lightning-dagster gateway serve` as a child process, exiting with its parent. The keys, the store's
    URL (it may hold a password) and the options reach it on its standard input, never in its environment or
    command line."""

    def __init__(
        self,
        store_url: str,
        model_dir: Path | str | None,
        options: GatewayOptions,
        keys: GatewayKeys,
        *,
        resource_id: str | None = None,
    ) -> None:
        # a vLLM engine takes 30 s to a few minutes to start (compiled, or a large model): it has its own
        # start timeout, which this one must outlast
        start_timeout_s = 900.0 if options.serving.engine == "vllm" else 120.0
        self.keys = keys
        self.host = options.serving.host
        self.workdir = Path(tempfile.mkdtemp(prefix="ld-gateway-"))
        self.log_path = self.workdir / "gateway.log"
        self._pushes = 0
        if model_dir is not None:
            # with an upstream, the served model's tokenizer: the child sends exact token-id prompts upstream
            source = ["--tokenizer" if options.serving.upstream_url else "--model", str(model_dir)]
        elif options.serving.upstream_url:
            source = []
        else:
            raise ValueError("a gateway process needs a model directory or an upstream URL")
        if resource_id:
            source += ["--resource-id", resource_id]
        # The child reads pushed weights from our workdir only, plus any roots the caller allows.
        options = options.updated({"model_roots": [*options.model_roots, self.workdir]})
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENV_NAMES}
        # A free port is picked here and bound by the child: another process may take it in between.
        # That start fails with "address already in use" in the log, and is retried on a new port.
        port = options.serving.port
        attempts = PORT_ATTEMPTS if port == 0 else 1
        for attempt in range(1, attempts + 1):
            self.port = port or _free_port(self.host)
            # on standard input, never in the environment or command line (readable in /proc): see above
            handed = {**asdict(keys), "store_url": store_url,
                      "options": options.with_serving(port=self.port).model_dump(mode="json")}  # fmt: skip
            argv = [sys.executable, "-m", "lightning_dagster.cli", "gateway", "serve", *source,
                    "--secrets-stdin", "--exit-with-parent"]  # fmt: skip
            with self.log_path.open("wb") as log:
                self._proc = subprocess.Popen(
                    argv, env=env, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT
                )
            try:
                self._proc.stdin.write(json.dumps(handed).encode() + b"\n")
                self._proc.stdin.close()
            except BrokenPipeError:
                pass  # the child died before reading: `_wait_ready` reports it with its log
            try:
                self._wait_ready(start_timeout_s)
                return
            except GatewayProcessError:
                if attempt == attempts or "address already in use" not in self._tail().lower():
                    shutil.rmtree(self.workdir, ignore_errors=True)
                    raise

    @property
    def admin_key(self) -> str:
        return self.keys.admin_key

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:].strip()
        except OSError:
            return ""

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float = 600.0) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": f"Bearer {self.admin_key}", "Content-Type": "application/json"}
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            raise GatewayProcessError(f"{method} {path} -> {exc.code}: {detail}") from exc

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc.poll() is not None:
                raise GatewayProcessError(
                    f"the gateway process exited with status {self._proc.returncode}:\n{self._tail()}"
                )
            try:
                self._request("GET", "/admin/health", timeout=2.0)
                return
            # GatewayProcessError: an HTTP error, e.g. from whatever else took the port before the child
            except (urllib.error.URLError, ConnectionError, TimeoutError, GatewayProcessError):
                pass
            if time.monotonic() > deadline:
                tail = self._tail()
                self.stop()
                raise GatewayProcessError(f"the gateway did not answer within {timeout_s:g}s:\n{tail}")
            time.sleep(0.1)

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stats(self) -> dict:
        """The child's `/admin/stats`: token-in counts and the engine's occupancy counters."""
        return self._request("GET", "/admin/stats")

    def verify(self) -> None:
        """GatewayProcessError unless the child's engine still serves the weights it last verified."""
        self._request("POST", "/admin/weights/verify")

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], resource_id: str | None = None) -> None:
        """Write the weights next to the child and have it load them; returns once they serve."""
        from lightning_dagster.engine.build import save_weights

        self._push(lambda partial: save_weights(state_dict, partial), resource_id)

    def load_weights_file(self, weights: Path, resource_id: str | None = None) -> None:
        """Have the child serve a safetensors file (copied next to it: it reads only its model roots)."""
        self._push(lambda partial: shutil.copyfile(weights, partial), resource_id)

    def _push(self, write: Callable[[Path], object], resource_id: str | None) -> None:
        """The file is written under a new name and renamed, so the child never reads a half-written one."""
        if self._proc.poll() is not None:
            raise GatewayProcessError(f"the gateway process has exited:\n{self._tail()}")
        self._pushes += 1
        path = self.workdir / "weights.safetensors"
        partial = self.workdir / f"weights-{self._pushes}.partial"
        write(partial)
        os.replace(partial, path)
        self._request("POST", "/admin/weights", {"path": str(path), "resource_id": resource_id})

    def terminate(self) -> None:
        """Ask the child to exit (SIGTERM) without waiting; `stop` waits and cleans up."""
        if self._proc.poll() is None:
            self._proc.terminate()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the child (gracefully, then by force) and remove its pushed weights and log."""
        self.terminate()
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
