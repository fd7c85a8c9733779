"""Schema creation and upgrade: versioned, idempotent, and safe when processes open a fresh DB at once."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory

from lightning_dagster.store import Store, migrate
from lightning_dagster.store.schema import metadata
from tests.store.conftest import run_processes


def test_head_constant_matches_the_migration_scripts():
    assert ScriptDirectory(str(migrate.MIGRATIONS_DIR)).get_current_head() == migrate.HEAD


def _open(url: str, barrier) -> str | None:
    barrier.wait()
    store = Store(url)
    with store.engine.connect() as c:
        return migrate.current_revision(c)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fresh_url(request, tmp_path) -> str:
    """A brand-new database (on PostgreSQL: its own database, default `public` schema)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    return request.getfixturevalue("postgres_url")


def test_concurrent_first_open_creates_the_schema_once(fresh_url):
    revisions = run_processes(_open, [(fresh_url,)] * 4)
    assert revisions == [migrate.HEAD] * 4
    store = Store(fresh_url)  # and a later open changes nothing
    with store.engine.connect() as c:
        assert c.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all() == [migrate.HEAD]
        assert set(metadata.tables) <= set(sa.inspect(c).get_table_names())
    store.close()


def test_an_unversioned_database_is_upgraded_by_the_scripts_keeping_its_rows(store_url):
    # Tables present but no version recorded: the script path runs (not create-from-scratch) and keeps data.
    engine = sa.create_engine(store_url)
    metadata.create_all(engine)
    with engine.begin() as c:
        c.execute(sa.text("INSERT INTO flags (key, value, updated_at) VALUES ('k', '{\"x\": 1}', 0)"))
    engine.dispose()
    store = Store(store_url)
    with store.engine.connect() as c:
        assert migrate.current_revision(c) == migrate.HEAD
    assert store.get_flag("k") == {"x": 1}
    store.close()


def test_default_url_is_a_sqlite_file_in_the_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path))
    monkeypatch.delenv("LD_STORE_URL", raising=False)
    with Store() as store:
        assert store.url == f"sqlite:///{tmp_path / 'store.db'}"
        store.set_flag("k", {"v": 1})
    with Store() as again:
        assert again.get_flag("k") == {"v": 1}
        with again.engine.connect() as c:
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000


def test_tables_hold_every_field_of_the_data_model():
    # A field added to lightning_dagster/types.py needs a column and a migration; this names the gap.
    from lightning_dagster.store import schema
    from lightning_dagster.store.spans import _SPAN_COLUMNS, _TOKEN_FIELDS
    from lightning_dagster.types import Attempt, Resource, Reward, Rollout, Span

    for model, table in [
        (Resource, schema.resources),
        (Rollout, schema.rollouts),
        (Attempt, schema.attempts),
        (Reward, schema.rewards),
    ]:
        assert set(model.model_fields) <= set(table.c.keys()), table.name
    token_columns = {"prompt_ref", "prompt_shared", "prompt_tail", "response_ids", "response_logprobs"}
    assert set(Span.model_fields) - set(_TOKEN_FIELDS) | token_columns == set(_SPAN_COLUMNS)
