"""Many concurrent callers -> one batched `Engine.generate`: a background thread gathers requests for up to
`max_wait_ms` (or until `max_batch`) and resolves each caller's future with its own Generation."""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from lightning_dagster.engine.engine import Engine, EngineError, Generation, SamplingParams


class EngineClosed(RuntimeError):
    """`submit` after `close()`, or a request still queued when the engine closed."""


_Request = tuple[list[int], SamplingParams, Future]


class BatchingEngine:
    def __init__(self, engine: Engine, *, max_batch: int = 64, max_wait_ms: float = 5.0) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.batches_run = 0  # observability: how many generate() calls served the requests
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="batching-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future[Generation]:
        """Queue one request. Every failure reaches the returned future: invalid input (`EngineError`) is
        set at once, before it could join a batch; `EngineClosed` after `close()`."""
        future: Future[Generation] = Future()
        try:
            self.engine.validate([prompt_ids], params)
        except EngineError as exc:
            future.set_exception(exc)
            return future
        with self._close_lock:
            if self._closed:
                future.set_exception(EngineClosed("the batching engine is closed"))
            else:
                self._queue.put((list(prompt_ids), params, future))
        return future

    def close(self) -> None:
        """Finish the batch in flight, fail whatever is still queued, stop the thread."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> BatchingEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return self._drain()
            batch = [first]
            deadline = time.monotonic() + self.max_wait_s
            stop = False
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._run(batch)
            if stop:
                return self._drain()

    def _run(self, batch: list[_Request]) -> None:
        batch = [r for r in batch if r[2].set_running_or_notify_cancel()]
        if self._closed:  # close() was called while these waited: fail them rather than delay close
            for r in batch:
                r[2].set_exception(EngineClosed("the batching engine closed before this request ran"))
            return
        if not batch:
            return
        self.batches_run += 1
        try:
            results = self.engine.generate([r[0] for r in batch], [r[1] for r in batch])
        except Exception as exc:  # noqa: BLE001 - every error must reach the callers' futures
            if len(batch) == 1 or not isinstance(exc, EngineError):
                for r in batch:
                    r[2].set_exception(exc)
                return
            # One bad request must not fail its batch mates: serve them one by one.
            for r in batch:
                try:
                    r[2].set_result(self.engine.generate([r[0]], [r[1]])[0])
                except Exception as single:  # noqa: BLE001
                    r[2].set_exception(single)
            return
        for r, result in zip(batch, results, strict=True):
            r[2].set_result(result)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[2].set_running_or_notify_cancel():
                item[2].set_exception(EngineClosed("the batching engine closed before this request ran"))
