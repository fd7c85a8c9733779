"""Schema migrations with alembic when a `Store` opens (a fresh database: `schema.metadata` stamped at head),
under a database-wide lock, so processes opening a fresh database at once create it once."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa

from lightning_dagster.store import schema

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
HEAD = "0003"  # the newest revision in migrations/versions (a test keeps the two in step)
_PG_LOCK_KEY = 0x4C445354  # any constant, shared by every process migrating this schema


def current_revision(conn: sa.Connection) -> str | None:
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: sa.Engine, writer: sa.Engine) -> None:
    """Bring the database to HEAD; `writer` is `engine` with the option that makes SQLite BEGIN IMMEDIATE."""
    with engine.connect() as conn:
        if current_revision(conn) == HEAD:
            return  # the common case costs one query and no alembic import
    from alembic import command
    from alembic.config import Config

    with writer.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
        current = current_revision(conn)  # re-read under the lock: another process may have migrated
        if current == HEAD:
            return
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
        cfg.attributes["connection"] = conn
        if current is None and not sa.inspect(conn).has_table("rollouts"):
            schema.metadata.create_all(conn)
            command.stamp(cfg, "head")
        else:
            command.upgrade(cfg, "head")
