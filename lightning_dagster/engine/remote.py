"""A `BatchingEngine` in a process of its own, behind the same interface. Why: in a gateway process the decode
loop shares one interpreter lock with the HTTP event loop and the span writers (benchmarks/README.md, rollout
path: ~47 ms a decode step in the gateway process against ~25 ms in a bare loop).

Protocol: pickled tuples over a socket pair: token ids and sampling parameters in (the gateway renders and
tokenizes, `RemoteCodec`), each `Generation` or exception out as its row finishes. Weights go as a
safetensors file path, never pickled tensors. The child exits when its connection closes.
"""

from __future__ import annotations

import itertools
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from lightning_dagster.engine.batch import NonFiniteLogits
from lightning_dagster.engine.batching import EngineClosed
from lightning_dagster.engine.chat import ChatCodec
from lightning_dagster.engine.engine import DeviceUnavailable, StateDictMismatch
from lightning_dagster.engine.sampling import EngineError, Generation, SamplingParams

# exceptions that cross the connection as themselves; any other becomes an EngineProcessError with its text
_KNOWN = (EngineError, EngineClosed, StateDictMismatch, NonFiniteLogits, DeviceUnavailable)
# memory-backed temp space when there is some: weights written there never touch the disk
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


START_TIMEOUT_S = 600.0


class EngineProcessError(RuntimeError):
    """The engine process failed to start, died, or failed a request with an error of its own."""


def _portable(exc: BaseException) -> BaseException:
    if isinstance(exc, _KNOWN):
        try:
            pickle.dumps(exc)
            return exc
        except Exception:  # noqa: BLE001 - an exception that does not pickle crosses as text
            pass
    return EngineProcessError(f"{type(exc).__name__}: {exc}")


class RemoteCodec(ChatCodec):
    """The served checkpoint's text side in the gateway's process; weight loads go to the engine process."""

    def __init__(self, owner: EngineProcess, model_dir: Path | str) -> None:
        super().__init__(model_dir)
        self._owner = owner

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        self._owner.load_weights(state_dict)


class EngineProcess:
    """An `Engine` and its `BatchingEngine` in a child process. `submit`'s future is resolved by a reader
    thread; every failure reaches it (`EngineClosed` after `close()` or when the child died)."""

    def __init__(self, model_dir: Path | str, *, max_batch: int = 64, threads: int = 1, device: str = "auto"):
        self.model_dir = Path(model_dir)
        ours, theirs = socket.socketpair()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "lightning_dagster.engine.remote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = itertools.count()
        self._closed = False
        self._exit_reason: str | None = None
        engine_kw = {"threads": threads, "device": device}
        try:
            self._send(("start", str(self.model_dir), max_batch, engine_kw))
            self.engine = RemoteCodec(self, self.model_dir)  # loads while the child imports torch
            if not self._conn.poll(START_TIMEOUT_S):
                raise EngineProcessError(f"the engine process did not start within {START_TIMEOUT_S:.0f} s")
            kind, info = self._conn.recv()
        except EOFError:
            self._kill()
            raise EngineProcessError(
                f"the engine process exited while starting (code {self._proc.wait()})"
            ) from None
        except BaseException:
            self._kill()
            raise
        if kind == "error":
            self._kill()
            raise info
        self.vocab_size: int = info["vocab_size"]
        self.pid = self._proc.pid
        self._reader = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._reader.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future[Generation]:
        future, rid = self._request("submit", list(prompt_ids), params)
        if rid is not None:
            future.add_done_callback(lambda f: self._cancelled(f, rid))
        return future

    def counters(self) -> dict[str, float]:
        return self._call("counters")

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Serve `state_dict` from the next admitted row on; all or nothing (`StateDictMismatch`)."""
        from lightning_dagster.engine.build import save_weights

        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=_SCRATCH)
        os.close(fd)
        try:
            save_weights(state_dict, path)
            self.load_weights_file(path)
        finally:
            os.unlink(path)

    def load_weights_file(self, path: Path | str) -> None:
        self._call("load", str(path))

    def close(self) -> None:
        """Finish the rows in flight, fail what is still queued, stop the child."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._exit_reason = "the engine process is closed"
        try:
            self._send(("close",))
        except (OSError, ValueError):
            pass
        self._reader.join(timeout=120)
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._kill()
        self._fail_all("the engine process is closed")
        self._conn.close()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _request(self, kind: str, *args: Any) -> tuple[Future, int | None]:
        """Send one request: its future, and its id (None: failed at once, the child is closed or gone)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(EngineClosed(self._exit_reason or "the engine process is closed"))
                return future, None
            rid = next(self._ids)
            self._pending[rid] = future
        try:
            self._send((kind, rid, *args))
        except (OSError, ValueError) as exc:  # the child closed its end: it exited, or is exiting
            self._fail_all(f"the engine process exited (code {self._exit_code()}): {exc}")
            return future, None
        return future, rid

    def _call(self, kind: str, *args: Any) -> Any:
        return self._request(kind, *args)[0].result()

    def _cancelled(self, future: Future, rid: int) -> None:
        if future.cancelled():
            with self._lock:
                self._pending.pop(rid, None)
                closed = self._closed
            if not closed:
                try:
                    self._send(("cancel", rid))
                except (OSError, ValueError):
                    pass

    def _read(self) -> None:
        while True:
            try:
                _, rid, outcome = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future = self._pending.pop(rid, None)
            if future is None or future.done():
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        code = self._exit_code()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._exit_reason = f"the engine process exited (code {code})"
            reason = self._exit_reason
        self._fail_all(reason)

    def _exit_code(self) -> int | None:
        """The child's exit code, waiting up to 5 s for it to exit (None: still running)."""
        try:
            return self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def _fail_all(self, reason: str | None) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(EngineClosed(reason or "the engine process is closed"))

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()


def _serve(conn: Connection) -> int:
    from lightning_dagster.engine.batching import BatchingEngine
    from lightning_dagster.engine.engine import Engine

    _, model_dir, max_batch, engine_kw = conn.recv()
    try:
        engine = Engine(model_dir, **engine_kw)
        batching = BatchingEngine(engine, max_batch=max_batch)
    except Exception as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("error", _portable(exc)))
        return 1
    conn.send(("ready", {"vocab_size": engine.vocab_size}))
    send_lock = threading.Lock()
    futures: dict[int, Future] = {}

    def send(rid: int, outcome: Any) -> None:
        with send_lock:
            try:
                conn.send(("done", rid, outcome))
            except (OSError, ValueError):  # the parent is gone; the loop below ends on EOF
                pass

    def finished(future: Future, rid: int) -> None:
        futures.pop(rid, None)
        if future.cancelled():
            return
        exc = future.exception()
        send(rid, _portable(exc) if exc is not None else future.result())

    def run(rid: int, call: Any) -> None:
        try:
            outcome = call()
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            outcome = _portable(exc)
        send(rid, outcome)

    def load(path: str) -> None:
        from safetensors.torch import load_file

        try:
            state = load_file(path)
        except Exception as exc:  # noqa: BLE001 - an unreadable file is the caller's error
            raise StateDictMismatch(f"cannot read weights from {path!r}: {exc}") from None
        engine.load_weights(state)

    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        kind = message[0]
        if kind == "submit":
            _, rid, prompt, params = message
            future = batching.submit(prompt, params)
            futures[rid] = future
            future.add_done_callback(lambda f, rid=rid: finished(f, rid))
        elif kind == "cancel":
            future = futures.get(message[1])
            if future is not None:
                future.cancel()  # only a request not yet admitted can be cancelled
        elif kind == "counters":
            run(message[1], batching.counters)
        elif kind == "load":
            # waits for the running rows to drain: on its own thread, so requests keep arriving meanwhile
            rid, path = message[1], message[2]
            threading.Thread(target=run, args=(rid, lambda p=path: load(p)), daemon=True).start()
        elif kind == "close":
            break
    batching.close()  # finishes the rows in flight (their results are sent), fails the queued ones
    conn.close()
    return 0


if __name__ == "__main__":
    fd = int(sys.argv[1])
    sys.exit(_serve(Connection(fd)))
