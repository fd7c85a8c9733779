"""MLflow outages (a real server stopped and restarted on the same backend), the command, the roles file."""

from __future__ import annotations

import json
import time

import pytest
from mlflow import MlflowClient

from lightning_dagster.registry import APPROVED, Registry, RegistryUnavailable
from lightning_dagster.release import promotion
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt


class StopsMlflowAfterMove:
    """The real store, except that MLflow goes down right after the pointer moved: the worst moment."""

    def __init__(self, store, server):
        self._store, self._server = store, server

    def move_pointer(self, *args, **kwargs):
        move = self._store.move_pointer(*args, **kwargs)
        self._server.stop()
        return move

    def __getattr__(self, name):
        return getattr(self._store, name)


def _mirror(tracking, model_name: str) -> tuple[str | None, list[str]]:
    rm = MlflowClient(tracking.uri, tracking.uri).get_registered_model(model_name)
    alias = rm.aliases.get(APPROVED)
    history = json.loads(rm.tags.get(f"{APPROVED}.history", "[]"))
    return (None if alias is None else str(alias)), [e["to"] for e in history]


@pytest.mark.slow
@pytest.mark.parametrize("tracking", ["postgres"], indirect=True)
def test_mlflow_outage_fails_clearly_and_heals(registry, variant, tracking, approver_keys):
    server = tracking.server
    parent = registry.register_initial_parent(variant(0))
    first, second = (registry.log_candidate(variant(k), **candidate_kwargs(parent.version)) for k in (1, 2))
    for receipt_id, old, new in (("rec-fault-1", parent, first), ("rec-fault-2", first, second)):
        receipt = passing_receipt(registry, old, new, receipt_id, approver_keys)
        approve(registry, receipt, approver_keys, "alice")

    # 1. MLflow dies between the store's move and the mirror: the promotion stands, the mirror lags.
    registry.store = StopsMlflowAfterMove(registry.store, server)
    try:
        result = promotion.promote(registry, "rec-fault-1", "alice", key=approver_keys["alice"])
    finally:
        registry.store = registry.store._store
    assert result.move.to_value == first.version and not result.mirrored
    assert "unavailable" in result.mirror_error

    # 2. With MLflow down: promotion fails fast with a clear error and moves nothing; the drill reports
    #    the rollback evidence as unavailable, not healthy.
    start = time.monotonic()
    with pytest.raises(RegistryUnavailable, match="unavailable"):
        promotion.promote(registry, "rec-fault-2", "alice", key=approver_keys["alice"])
    assert time.monotonic() - start < 15
    assert [m.to_value for m in registry.history()] == [parent.version, first.version]
    drill = registry.rollback_drill(parent.version, record=False)
    assert not drill.resolved and not drill.ok and drill.unavailable and "unavailable" in drill.error
    evidence = drill.to_receipt_drill("res-parent")
    assert (evidence.resolved, evidence.loaded, evidence.routed_back) == (None, None, None)

    # 3. The server comes back on the same backend store: the mirror is still behind until the next
    #    registry operation reconciles it; then pointer, alias and history agree.
    server.start()
    assert _mirror(tracking, registry.model_name) == (parent.version, [parent.version])
    assert registry.resolve(APPROVED, download=False).version == first.version
    store_history = [m.to_value for m in registry.history()]
    assert _mirror(tracking, registry.model_name) == (first.version, store_history)
    assert promotion.promote(registry, "rec-fault-2", "alice", key=approver_keys["alice"]).mirrored
    assert _mirror(tracking, registry.model_name) == (
        second.version,
        [parent.version, first.version, second.version],
    )


def test_registry_against_unreachable_server_is_unavailable(tmp_path, roles_file):
    from lightning_dagster.store import Store
    from tests.registry.mlflow_server import free_port

    registry = Registry(
        f"http://127.0.0.1:{free_port()}", Store(f"sqlite:///{tmp_path / 's.db'}"), roles_file=roles_file
    )
    with pytest.raises(RegistryUnavailable):
        registry.resolve(APPROVED)
    drill = registry.rollback_drill("1")
    assert not drill.resolved and "unavailable" in drill.error


def _init_and_use(uri: str, name: str, queue) -> None:
    try:
        from lightning_dagster.registry.tracking import ensure_tracking_store

        ensure_tracking_store(uri)
        queue.put(
            (name, MlflowClient(uri, uri).create_experiment(name, artifact_location="file:///tmp/unused"))
        )
    except Exception as exc:
        queue.put((name, f"error {type(exc).__name__}: {exc}"))


@pytest.mark.slow
def test_fresh_sqlite_tracking_store_initialised_once_under_concurrency(tmp_path):
    """Three processes open one fresh SQLite tracking DB at once: the lock lets exactly one migrate."""
    import multiprocessing

    uri = f"sqlite:///{tmp_path / 'fresh.db'}"
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_init_and_use, args=(uri, f"exp{i}", queue)) for i in range(3)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert all(not str(v).startswith("error") for v in results.values()), results
    assert {e.name for e in MlflowClient(uri, uri).search_experiments()} >= {"exp0", "exp1", "exp2"}
