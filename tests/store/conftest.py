"""Every store test runs twice: on a SQLite file and on a real PostgreSQL server."""

from __future__ import annotations

import multiprocessing
import traceback
import uuid

import pytest
import sqlalchemy as sa

from lightning_dagster.store import Store


@pytest.fixture(scope="session")
def postgres_store_db(postgres_server):
    """One database for the store tests; each test gets its own schema in it (much cheaper than a
    CREATE DATABASE per test, and just as isolated for the store, which uses the search_path schema)."""
    url = postgres_server.url(postgres_server.create_database("store"))
    engine = sa.create_engine(url)
    yield url, engine
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'store.db'}"
    url, engine = request.getfixturevalue("postgres_store_db")
    schema = f"t_{uuid.uuid4().hex[:10]}"
    with engine.begin() as c:
        c.execute(sa.text(f"CREATE SCHEMA {schema}"))
    return f"{url}?options=-csearch_path%3D{schema}"


@pytest.fixture
def store(store_url):
    s = Store(store_url)
    yield s
    s.close()


def _child(target, args, barrier, out) -> None:
    try:
        out.put(("ok", target(*args, barrier)))
    except BaseException:  # report, so the parent fails with the child's traceback instead of a timeout
        out.put(("error", traceback.format_exc()))


def run_processes(target, args_list: list[tuple], timeout: float = 60.0) -> list:
    """Run `target(*args, barrier)` in one forked process per args tuple and return the results.

    Each target opens its own Store and waits on the barrier, so all of them race at once. The parent's
    engines must be disposed first: no pooled connection may cross a fork."""
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(len(args_list)), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(target, args, barrier, out)) for args in args_list]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(timeout)
    errors = [r for status, r in results if status == "error"]
    assert not errors, errors[0]
    return [r for _, r in results]
