"""Group commit of spans: one writer thread drains every span queued meanwhile into one `add_spans` call.
`write(wait=False)` (write-behind) returns at once, and the writer lingers up to `linger_s`; a waiting write
is a barrier for everything queued before it (FIFO). A batch is synced if any of its writes asks for it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future

from lightning_dagster.gateway.errors import GatewayError, store_error
from lightning_dagster.types import Span

log = logging.getLogger(__name__)

_STOP = object()


class SpanWriter:
    def __init__(self, store, *, max_batch: int = 512, linger_s: float = 0.0):
        self._store = store
        self._max_batch = max_batch
        self._linger_s = linger_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending = 0  # writes queued or being committed

    @property
    def idle(self) -> bool:
        """Nothing queued or in flight: a write made elsewhere now cannot overtake an earlier one."""
        return self._pending == 0

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="gateway-span-writer", daemon=True)
                self._thread.start()

    async def write(self, spans: list[Span], *, wait: bool = True, sync: bool = True) -> None:
        self._ensure_thread()
        future: Future | None = Future() if wait else None
        with self._lock:
            self._pending += 1
        self._queue.put((spans, future, sync))
        if future is not None:
            await asyncio.wrap_future(future)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            batch = [item]
            deadline = time.monotonic() + self._linger_s
            while len(batch) < self._max_batch:
                # Linger only while nobody waits on this batch.
                linger = deadline - time.monotonic() if all(f is None for _, f, _ in batch) else 0.0
                try:
                    nxt = self._queue.get(timeout=linger) if linger > 0 else self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    self._queue.put(_STOP)
                    break
                batch.append(nxt)
            try:
                self._commit(batch)
            finally:
                with self._lock:
                    self._pending -= len(batch)

    def _commit(self, batch: list[tuple[list[Span], Future | None, bool]]) -> None:
        try:
            sync = any(sync for _, _, sync in batch)
            self._store.add_spans([s for spans, _, _ in batch for s in spans], sync=sync)
        except Exception as exc:
            if len(batch) == 1:
                spans, future, _ = batch[0]
                log.exception("span write failed (attempt %s)", spans[0].attempt_id if spans else "?")
                if future is not None:
                    future.set_exception(
                        store_error(exc) or GatewayError(500, "the span could not be stored")
                    )
                return
            # One bad span must not fail its batch mates: retry them one request at a time.
            for one in batch:
                self._commit([one])
            return
        for _, future, _ in batch:
            if future is not None:
                future.set_result(None)

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=10)
