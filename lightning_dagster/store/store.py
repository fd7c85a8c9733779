"""The durable store over SQLite (WAL, `BEGIN IMMEDIATE` writes) or PostgreSQL (`SKIP LOCKED` claims),
every public method one transaction, a mixin per concern."""

from __future__ import annotations

from lightning_dagster import paths
from lightning_dagster.store.queue import RolloutQueue
from lightning_dagster.store.spans import SpanStore
from lightning_dagster.store.weights import WeightVersions


class Store(SpanStore, RolloutQueue, WeightVersions):
    """See docs/CONTRACTS.md `store`. Thread-safe; in a forked child, open a new Store."""

    def __init__(self, url: str | None = None, *, busy_timeout_s: float = 30.0):
        self._connect(url or paths.store_url(), busy_timeout_s)
        self._open_spans()

    def close(self) -> None:
        self._close_spans()
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
