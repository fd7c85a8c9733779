"""The store's connection: engine, SQLite pragmas and write locking, schema upgrade on open, and the
transaction and record helpers every part of `Store` builds on."""

from __future__ import annotations

import functools
import importlib.util
import math
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core
import sqlalchemy as sa
from pydantic import BaseModel

from lightning_dagster.store import migrate
from lightning_dagster.store.errors import (
    Conflict,
    InvalidInput,
    NotFound,
    StoreLocked,
    StoreReadOnly,
    StoreUnavailable,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def as_record(model: type[M], value: Any) -> M:
    """Accept the record or its mapping; anything else fails pydantic validation (a ValueError)."""
    return value if isinstance(value, model) else model.model_validate(value)


def from_row(model: type[M], row: sa.Row) -> M:
    m = row._mapping
    return model.model_validate({k: m[k] for k in model.model_fields})


def to_row(record: BaseModel) -> dict[str, Any]:
    return record.model_dump(mode="json")


def enum_values(enum_cls: type, value: Any) -> list[str]:
    """One enum member or several, as stored strings; an unknown value raises ValueError."""
    items = [value] if isinstance(value, str) else list(value)
    return [enum_cls(v).value for v in items]


def nonempty_text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{name} must be a non-empty string, got {value!r}")
    return value


def dump_json(value: Any) -> str:
    return pydantic_core.to_json(value).decode()  # ~6x faster than json.dumps: one per span at ingest


_JSON = {"json_serializer": dump_json, "json_deserializer": pydantic_core.from_json}
_INT32 = (-(2**31), 2**31 - 1)


def bad_json(value: Any, path: str = "") -> str | None:
    """`path: what is wrong` for the first NaN, Infinity or NUL character PostgreSQL's JSON refuses."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{path}: {value} is not a finite number"
    if isinstance(value, str):
        return f"{path}: contains a NUL character" if "\x00" in value else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and "\x00" in key:
            return f"{path}: a key contains a NUL character"
        if found := bad_json(item, f"{path}.{key}" if path else str(key)):
            return found
    return None


# A JSON number a float cannot hold (an infinity once parsed): a 3-digit exponent (1e999) or 309+ digits.
# Anchored where a JSON number starts, so text merely containing "e123" rarely sends a body to the walk.
_HUGE_NUMBER = re.compile(rb"[:\[,\s]-?(?:\d+(?:\.\d*)?[eE][+-]?\d{3}|\d{309})")


def suspect_json(text: bytes) -> bool:
    """Whether JSON text may hold NaN, an infinity or a NUL character (a byte search; `bad_json` decides)."""
    return (
        b"NaN" in text or b"Infinity" in text or b"\\u0000" in text or _HUGE_NUMBER.search(text) is not None
    )


def check_json(field: str, value: Any) -> None:
    """Raise InvalidInput naming the path of a NaN, an Infinity or a NUL character inside `value`."""
    text = pydantic_core.to_json(value)  # C speed; the walk runs only when a suspect token appears
    if suspect_json(text) and (found := bad_json(value, field)):
        raise InvalidInput(found)


@functools.cache
def _column_checks(table: sa.Table) -> list[tuple[str, str, int | None, bool, bool]]:
    """(column, `table.column`, declared string length, integer?, JSON?) per column, once per table."""
    return [
        (
            c.name,
            f"{table.name}.{c.name}",
            getattr(c.type, "length", None),
            isinstance(c.type, sa.Integer),
            isinstance(c.type, sa.JSON),
        )
        for c in table.c
    ]


def checked(table: sa.Table, row: dict[str, Any]) -> dict[str, Any]:
    """The row, if both stores can hold it alike; else InvalidInput naming the column (SQLite would keep an
    over-long string, a NUL character, NaN or an int beyond 32 bits, which PostgreSQL refuses)."""
    for name, where, limit, integer, json in _column_checks(table):
        value = row.get(name)
        if value is None:
            continue
        if isinstance(value, str):
            if "\x00" in value:
                raise InvalidInput(f"{where}: contains a NUL character")
            if limit is not None and len(value) > limit:
                raise InvalidInput(f"{where}: {len(value)} characters; the limit is {limit}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidInput(f"{where}: {value} is not a finite number")
        elif integer and isinstance(value, int):
            if not _INT32[0] <= value <= _INT32[1]:
                raise InvalidInput(f"{where}: {value} is outside the 32-bit integer range")
        elif json:
            check_json(where, value)
    return row


def _retry_locked(fn: Callable[[], T], timeout_s: float) -> T:
    """Retry the "database is locked" of a fresh file's WAL switch, which busy_timeout misses (once in 150
    races); idempotent steps only."""
    deadline, delay = time.monotonic() + timeout_s, 0.005
    while True:
        try:
            return fn()
        except (sqlite3.OperationalError, sa.exc.OperationalError, StoreLocked) as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.2)


def unavailable(exc: BaseException, store: str, busy_timeout_s: float) -> StoreUnavailable | None:
    """The named error (one line) for a store that cannot serve the call at all; None for any other error."""
    orig = getattr(exc, "orig", None) or exc
    cause = (str(orig).strip().splitlines() or [type(orig).__name__])[0]
    code = getattr(orig, "pgcode", None)
    if "readonly" in cause or "read-only" in cause or code == "25006":
        return StoreReadOnly(f"the store {store} is read-only, so this command cannot write to it ({cause})")
    if "database is locked" in cause or code == "55P03":
        return StoreLocked(
            f"the store {store} is locked by another process; gave up after {busy_timeout_s:g}s ({cause})"
        )
    if code is None and _UNREACHABLE.search(cause):
        # No connection at all: psycopg2 says so before any statement (no SQLSTATE), SQLite as "unable
        # to open database file".
        return StoreUnavailable(f"the store {store} cannot be reached ({cause})")
    return None


_UNREACHABLE = re.compile(
    r"unable to open database file|could not connect|connection to server .* failed|connection refused|"
    r"could not translate host name|no such host|name or service not known|timeout expired",
    re.IGNORECASE,
)


def _translate_errors(engine: sa.Engine, url: str, busy_timeout_s: float) -> None:
    u = sa.make_url(url)
    store = u.database if u.get_backend_name() == "sqlite" else u.render_as_string(hide_password=True)

    @sa.event.listens_for(engine, "handle_error")
    def _named(context) -> BaseException | None:
        return unavailable(context.original_exception, store or url, busy_timeout_s)


def _create_engine(url: str, busy_timeout_s: float) -> sa.Engine:
    u = sa.make_url(url)
    backend = u.get_backend_name()
    pool: dict[str, Any] = {"pool_size": 10, "max_overflow": 40}
    if backend == "postgresql":
        if u.drivername == "postgresql" and importlib.util.find_spec("psycopg") is None:
            u = u.set(drivername="postgresql+psycopg2")  # SQLAlchemy 2.1 maps bare postgresql to psycopg 3
        # no pool_pre_ping (a round trip per call): a connection lost to a restart fails one call, then
        # the pool replaces it
    elif backend != "sqlite":
        raise InvalidInput(f"the store supports sqlite and postgresql URLs, not {backend!r}")
    elif u.database in (None, "", ":memory:"):
        pool = {"poolclass": sa.pool.StaticPool, "connect_args": {"check_same_thread": False}}
    else:
        if u.query.get("uri") != "true":  # `file:...?mode=ro&uri=true` names an existing file
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        pool["connect_args"] = {"timeout": busy_timeout_s}
    engine = sa.create_engine(u, **_JSON, **pool)
    _translate_errors(engine, url, busy_timeout_s)
    if backend == "postgresql":
        return engine

    @sa.event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record) -> None:
        # We issue BEGIN ourselves: pysqlite's implicit BEGIN skips DDL and cannot be IMMEDIATE.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
        # WAL: readers never block the writer, nor it them
        _retry_locked(lambda: cur.execute("PRAGMA journal_mode = WAL"), busy_timeout_s)
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @sa.event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        # A write locks up front, so two writers queue on busy_timeout (not SQLITE_BUSY on upgrade).
        # synchronous: FULL (2) fsyncs every commit, NORMAL (1) leaves it to the next (crash-safe).
        options = conn.get_execution_options()
        level = 1 if options.get("ld_nosync") else 2
        info = conn.connection.info
        if info.get("ld_synchronous") != level:
            conn.exec_driver_sql(f"PRAGMA synchronous = {level}")
            info["ld_synchronous"] = level
        conn.exec_driver_sql("BEGIN IMMEDIATE" if options.get("ld_write") else "BEGIN")

    return engine


_IDS_INLINE = 32  # id lists up to this long are bound one parameter per id


class Connection:
    """The engine and its transactions; the other parts of `Store` are mixins over this one."""

    url: str
    engine: sa.Engine

    def _ids_in(self, column: sa.ColumnElement, ids: Iterable[str]) -> sa.ColumnElement[bool]:
        """`column IN ids`; a long list as one JSON array (a parameter per id costs ~1 ms per 256 ids)."""
        ids = list(ids)
        if len(ids) <= _IDS_INLINE:
            return column.in_(ids)
        doc = sa.bindparam(None, dump_json(ids), type_=sa.String)
        if self.engine.dialect.name == "sqlite":
            rows = sa.select(sa.column("value")).select_from(sa.func.json_each(doc))
        else:
            rows = sa.select(sa.func.json_array_elements_text(sa.cast(doc, sa.JSON)))
        return column.in_(rows)

    def _connect(self, url: str, busy_timeout_s: float) -> None:
        """Open the engine and bring the schema to head; a read-only store opens if its schema is current."""
        self.url = url
        self.engine = _create_engine(url, busy_timeout_s)
        self._busy_timeout_s = busy_timeout_s
        self._writer = self.engine.execution_options(ld_write=True)
        self._writer_nosync = self.engine.execution_options(ld_write=True, ld_nosync=True)
        try:
            if self.engine.dialect.name == "sqlite":
                _retry_locked(lambda: migrate.upgrade(self.engine, self._writer), busy_timeout_s)
            else:
                migrate.upgrade(self.engine, self._writer)
        except StoreUnavailable:
            self.engine.dispose()
            raise

    @contextmanager
    def _write(self, *, sync: bool = True) -> Iterator[sa.Connection]:
        try:
            with (self._writer if sync else self._writer_nosync).begin() as conn:
                if not sync and conn.dialect.name == "postgresql":
                    conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
                yield conn
        except sa.exc.IntegrityError as exc:
            raise Conflict(str(exc.orig).strip()) from exc

    def _one(self, model: type[M], table: sa.Table, column: sa.Column, key: str) -> M:
        with self.engine.connect() as c:
            row = c.execute(sa.select(table).where(column == key)).first()
        if row is None:
            raise NotFound(f"{table.name[:-1]} {key!r} not found")
        return from_row(model, row)

    def _update_one(self, table: sa.Table, column: sa.Column, key: str, values: dict[str, Any]) -> None:
        with self._write() as c:
            if c.execute(sa.update(table).where(column == key).values(values)).rowcount == 0:
                raise NotFound(f"{table.name[:-1]} {key!r} not found")

    def _all(self, model: type[M], query: sa.Select) -> list[M]:
        with self.engine.connect() as c:
            return [from_row(model, row) for row in c.execute(query)]
