"""Many concurrent callers -> one running batch on a background thread. Continuous batching, the default:
between two decode steps the batch admits whatever is queued (up to `max_batch` rows), and each row resolves
its caller's future the moment it finishes. `continuous=False` keeps the static policy for comparison: run
each gathered batch to its end before looking at the queue again.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from lightning_dagster.engine.batch import Outcome, RunningBatch
from lightning_dagster.engine.engine import Engine
from lightning_dagster.engine.sampling import EngineError, Generation, SamplingParams


class EngineClosed(RuntimeError):
    """`submit` after `close()`, or a request still queued when the engine closed."""


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: Future[Generation]


class BatchingEngine:
    """Serves `submit` calls from many threads with one batched sampling loop, which gathers for up to
    `max_wait_ms` after an idle period. While rows run it holds the engine lock, so a weight push or a
    direct `generate` waiting for it stops admissions until the rows drain: every token of a request comes
    from one set of weights.

    Counters: `batches_run` admissions (prefill forwards), `steps_run` decode steps, `rows_stepped /
    steps_run` the mean batch size, `busy_s` the wall seconds the loop held the engine with rows to run.
    """

    def __init__(
        self, engine: Engine, *, max_batch: int = 64, max_wait_ms: float = 5.0, continuous: bool = True
    ) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000.0
        self.continuous = continuous
        self.batches_run = 0
        self.steps_run = 0
        self.rows_stepped = 0
        self.busy_s = 0.0
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="batching-engine", daemon=True)
        self._thread.start()

    def counters(self) -> dict[str, float]:
        """The counters above, as one dict (the gateway's `/admin/stats` reports them)."""
        return {name: getattr(self, name) for name in ("batches_run", "steps_run", "rows_stepped", "busy_s")}

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future[Generation]:
        """Queue one request; every failure reaches the returned future (`EngineError`, `EngineClosed`). It is
        resolved on the engine thread under the engine lock: a done-callback must not call `generate` or
        `load_weights`."""
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
                self._queue.put(_Request(list(prompt_ids), params, future))
        return future

    def close(self) -> None:
        """Finish the rows in flight, fail whatever is still queued, stop the thread."""
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
        batch = RunningBatch(self.engine)
        while True:
            first = self._queue.get()
            if first is None:
                return self._drain()
            pending, stop = self._take(self.max_batch, first=first, wait_s=self.max_wait_s)
            # the lock is not fair: let a weight push or generate() that is already waiting go first
            while self.engine.waiting:
                time.sleep(0.001)
            held: list[Outcome] = []  # static mode resolves a batch's rows together, at its end
            with self.engine.exclusive():
                started = time.perf_counter()
                try:
                    self._admit(batch, pending)
                    while batch:
                        room = self.max_batch - len(batch)
                        # a waiter (weight push, generate) is let in once the running rows drain
                        admitting = not stop and not self.engine.waiting and batch.can_admit()
                        if self.continuous and room and admitting:
                            pending, stop = self._take(room)
                            self._admit(batch, pending)
                            if not batch:
                                break
                        self.steps_run += 1
                        self.rows_stepped += len(batch)
                        outcomes = batch.step()
                        if self.continuous:
                            _resolve(outcomes)
                        else:
                            held += outcomes
                except Exception as exc:  # noqa: BLE001 - a bug here must not leave callers waiting forever
                    held += [(tag, exc) for tag in batch.abandon()]
                self.busy_s += time.perf_counter() - started
            _resolve(held)
            if stop:
                return self._drain()

    def _take(
        self, n: int, *, first: _Request | None = None, wait_s: float = 0.0
    ) -> tuple[list[_Request], bool]:
        """Up to n requests: `first` (the one that ended an idle period) plus whatever is queued or arrives
        within `wait_s`; True once close() was seen."""
        taken = [first] if first is not None else []
        deadline = time.monotonic() + wait_s
        while len(taken) < n:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                return taken, True
            taken.append(item)
        return taken, False

    def _admit(self, batch: RunningBatch, requests: list[_Request]) -> None:
        requests = [r for r in requests if r.future.set_running_or_notify_cancel()]
        if not requests:
            return
        if self._closed:  # close() was called while these waited: fail them rather than delay close
            for r in requests:
                r.future.set_exception(EngineClosed("the batching engine closed before this request ran"))
            return
        try:
            outcomes = batch.admit(
                [r.prompt for r in requests], [r.params for r in requests], [r.future for r in requests]
            )
            self.batches_run += 1
        except Exception as exc:  # noqa: BLE001 - every error must reach the callers' futures
            if len(requests) == 1:
                outcomes = [(requests[0].future, exc)]
            else:
                # One bad request must not fail its batch mates (admit is all or nothing): admit one by one.
                outcomes = []
                for r in requests:
                    try:
                        outcomes += batch.admit([r.prompt], [r.params], [r.future])
                        self.batches_run += 1
                    except Exception as single:  # noqa: BLE001
                        outcomes.append((r.future, single))
        _resolve(outcomes)

    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineClosed("the batching engine closed before this request ran"))


def _resolve(outcomes: list[Outcome]) -> None:
    for future, outcome in outcomes:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
