"""The durable store: resources, rollouts, attempts, spans, rewards, receipts, pointers and flags.

SQLAlchemy Core over SQLite (default; WAL, busy timeout, writes in `BEGIN IMMEDIATE`) or PostgreSQL (row
locks with `FOR NO KEY UPDATE`, queue claims with `SKIP LOCKED`). Every public method is one transaction.
"""

from __future__ import annotations

import importlib.util
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pydantic_core
import sqlalchemy as sa
from pydantic import BaseModel
from sqlalchemy.dialects import postgresql, sqlite

from lightning_dagster import config
from lightning_dagster.store import migrate, schema
from lightning_dagster.store.errors import Conflict, InvalidInput, NotFound, PointerConflict
from lightning_dagster.store.records import PointerMove, StoredDocument
from lightning_dagster.store.tokens import (
    pack_ids,
    pack_logprobs,
    shared_prefix,
    unpack_ids,
    unpack_logprobs,
)
from lightning_dagster.types import (
    TERMINAL_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    Resource,
    RetryKind,
    Reward,
    Rollout,
    RolloutKind,
    RolloutStatus,
    Span,
    SpanKind,
    check_transition,
    now,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
R, A, S = schema.rollouts.c, schema.attempts.c, schema.spans.c

# A rollout's status follows its latest attempt; whether a failure is final is the runner's call
# (it either retries, which re-queues the rollout, or leaves it failed).
ROLLOUT_STATUS_OF: dict[AttemptState, RolloutStatus] = {
    AttemptState.queued: RolloutStatus.queued,
    AttemptState.running: RolloutStatus.running,
    AttemptState.succeeded: RolloutStatus.succeeded,
    AttemptState.failed: RolloutStatus.failed,
    AttemptState.timeout: RolloutStatus.failed,
    AttemptState.unresponsive: RolloutStatus.failed,
    AttemptState.cancelled: RolloutStatus.cancelled,
}
FINAL_ROLLOUT_STATUSES = frozenset({RolloutStatus.succeeded, RolloutStatus.failed, RolloutStatus.cancelled})
_TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids", "response_logprobs")
_SPAN_SCALARS = tuple(f for f in Span.model_fields if f not in _TOKEN_FIELDS)
_SPAN_COLUMNS = tuple(col.name for col in schema.spans.c if col.name != "id")
_SQLITE_SPAN_INSERT = (
    f"INSERT INTO spans ({', '.join(_SPAN_COLUMNS)}) VALUES ({', '.join('?' * len(_SPAN_COLUMNS))})"
)
_CONTEXT_CACHE_SIZE = 2048  # attempts whose newest prompt+response is kept packed (~4-8 KB each)
_NOWAIT_CHECKPOINT_EVERY = 64  # every 64th `try_add_spans` defers to a blocking writer, which checkpoints
_KNOWN_PAIRS_SIZE = 65536  # (rollout, attempt) pairs already checked: an attempt never changes rollout


def _as(model: type[M], value: Any) -> M:
    """Accept the record or its mapping; anything else fails pydantic validation (a ValueError)."""
    return value if isinstance(value, model) else model.model_validate(value)


def _record(model: type[M], row: sa.Row) -> M:
    m = row._mapping
    return model.model_validate({k: m[k] for k in model.model_fields})


def _row(record: BaseModel) -> dict[str, Any]:
    return record.model_dump(mode="json")


def _values(enum_cls: type, value: Any) -> list[str]:
    """One enum member or several, as stored strings; an unknown value raises ValueError."""
    items = [value] if isinstance(value, str) else list(value)
    return [enum_cls(v).value for v in items]


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"{name} must be a non-empty string, got {value!r}")
    return value


def _json(value: Any) -> str:
    return pydantic_core.to_json(value).decode()  # ~6x faster than json.dumps: one per span at ingest


_JSON = {"json_serializer": _json, "json_deserializer": pydantic_core.from_json}


def _span_params(rows: list[dict[str, Any]]) -> list[tuple]:
    return [tuple(_json(row[k]) if k == "attributes" else row[k] for k in _SPAN_COLUMNS) for row in rows]


def _retry_locked(fn: Callable[[], T], timeout_s: float) -> T:
    """Retry SQLite's immediate "database is locked": processes opening a fresh file at once race its switch
    to WAL, and that lock is not covered by busy_timeout (seen once in 150 twelve-process races).
    Only for idempotent steps: the WAL pragma and the (transactional) schema upgrade."""
    deadline, delay = time.monotonic() + timeout_s, 0.005
    while True:
        try:
            return fn()
        except (sqlite3.OperationalError, sa.exc.OperationalError) as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(delay)
            delay = min(2 * delay, 0.2)


def _create_engine(url: str, busy_timeout_s: float) -> sa.Engine:
    u = sa.make_url(url)
    backend = u.get_backend_name()
    if backend == "postgresql":
        if u.drivername == "postgresql" and importlib.util.find_spec("psycopg") is None:
            u = u.set(drivername="postgresql+psycopg2")  # SQLAlchemy 2.1 maps bare postgresql to psycopg 3
        # no pool_pre_ping: it costs a round trip per call; a connection lost to a server restart fails
        # one call and is then replaced by the pool.
        return sa.create_engine(u, pool_size=10, max_overflow=40, **_JSON)
    if backend != "sqlite":
        raise InvalidInput(f"the store supports sqlite and postgresql URLs, not {backend!r}")
    if u.database in (None, "", ":memory:"):
        pool: dict[str, Any] = {"poolclass": sa.pool.StaticPool, "connect_args": {"check_same_thread": False}}
    else:
        Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        pool = {"pool_size": 10, "max_overflow": 40, "connect_args": {"timeout": busy_timeout_s}}
    engine = sa.create_engine(u, **_JSON, **pool)

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
        # A write transaction takes the write lock up front, so two writers queue on busy_timeout instead
        # of both reading and then one failing to upgrade its lock (SQLITE_BUSY without waiting).
        options = conn.get_execution_options()
        # synchronous is per connection: FULL (2) fsyncs the WAL at every commit; NORMAL (1) leaves the
        # commit in the WAL for the next synced commit or checkpoint (safe against a process crash).
        level = 1 if options.get("ld_nosync") else 2
        info = conn.connection.info
        if info.get("ld_synchronous") != level:
            conn.exec_driver_sql(f"PRAGMA synchronous = {level}")
            info["ld_synchronous"] = level
        conn.exec_driver_sql("BEGIN IMMEDIATE" if options.get("ld_write") else "BEGIN")

    return engine


class Store:
    """See docs/CONTRACTS.md `store`. Thread-safe; in a forked child, open a new Store."""

    def __init__(self, url: str | None = None, *, busy_timeout_s: float = 30.0):
        self.url = url or config.store_url()
        self.engine = _create_engine(self.url, busy_timeout_s)
        self._writer = self.engine.execution_options(ld_write=True)
        self._writer_nosync = self.engine.execution_options(ld_write=True, ld_nosync=True)
        # attempt_id -> (span_id, packed prompt + response) of the attempt's newest LLM span written here
        # (None: it had no spans when looked at). Another process may write newer spans of the same
        # attempt: a stale entry only makes the next prompt reference an older (still exact) context, or
        # none, so storage is less compact but never wrong.
        self._contexts: OrderedDict[str, tuple[str, bytes] | None] = OrderedDict()
        self._known: OrderedDict[tuple[str, str | None], None] = OrderedDict()  # checked (rollout, attempt)
        self._contexts_lock = threading.Lock()
        # SQLite file stores: span batches that need no lookup go through one plain sqlite3 connection per
        # thread (SQLAlchemy's begin/execute/commit machinery costs ~3x the insert and commit themselves).
        u = self.engine.url
        self._raw_path = (
            u.database
            if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:")
            else None
        )
        self._busy_timeout_s = busy_timeout_s
        self._raw_local = threading.local()
        self._raw_conns: list[sqlite3.Connection] = []
        if self.engine.dialect.name == "sqlite":
            _retry_locked(lambda: migrate.upgrade(self.engine, self._writer), busy_timeout_s)
        else:
            migrate.upgrade(self.engine, self._writer)

    def close(self) -> None:
        with self._contexts_lock:
            conns, self._raw_conns = self._raw_conns, []
        for conn in conns:
            conn.close()
        self.engine.dispose()

    def _raw_sqlite(self, nowait: bool) -> tuple[sqlite3.Connection, dict[str, Any]]:
        """This thread's plain connection (and its settings), one blocking and one `nowait`: that one never
        waits for the write lock and never checkpoints (which fsyncs), so it cannot stall its caller."""
        local = self._raw_local.__dict__
        key = "nowait" if nowait else "wait"
        if key not in local:
            conn = sqlite3.connect(
                self._raw_path, timeout=0 if nowait else self._busy_timeout_s, check_same_thread=False
            )
            conn.isolation_level = None
            conn.execute(f"PRAGMA busy_timeout = {0 if nowait else int(self._busy_timeout_s * 1000)}")
            conn.execute("PRAGMA foreign_keys = ON")  # the file is already in WAL mode (set at open)
            if nowait:
                conn.execute("PRAGMA wal_autocheckpoint = 0")
            local[key] = (conn, {"synchronous": None, "commits": 0})
            with self._contexts_lock:
                self._raw_conns.append(conn)
        return local[key]

    def _insert_spans_raw(self, rows: list[dict[str, Any]], sync: bool, nowait: bool) -> bool:
        """The same insert as `_insert_spans`, in its own `BEGIN IMMEDIATE` transaction, on plain sqlite3.
        `nowait`: False (nothing written) if another writer holds the lock."""
        (conn, state), level = self._raw_sqlite(nowait), 2 if sync else 1
        if state["synchronous"] != level:
            conn.execute(f"PRAGMA synchronous = {level}")
            state["synchronous"] = level
        params = _span_params(rows)
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if nowait and ("locked" in str(exc) or "busy" in str(exc)):
                return False
            raise
        try:
            conn.executemany(_SQLITE_SPAN_INSERT, params)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.IntegrityError):
                raise Conflict(str(exc).strip()) from exc
            raise
        state["commits"] += 1
        return True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        return _record(model, row)

    def _all(self, model: type[M], query: sa.Select) -> list[M]:
        with self.engine.connect() as c:
            return [_record(model, row) for row in c.execute(query)]

    # -- resources ---------------------------------------------------------------------------------------

    def add_resource(self, r: Resource) -> Resource:
        r = _as(Resource, r)
        with self._write() as c:
            c.execute(schema.resources.insert(), _row(r))
        return r

    def get_resource(self, resource_id: str) -> Resource:
        return self._one(Resource, schema.resources, schema.resources.c.resource_id, resource_id)

    def list_resources(self) -> list[Resource]:
        return self._all(Resource, sa.select(schema.resources).order_by(schema.resources.c.id))

    # -- rollouts and attempts ---------------------------------------------------------------------------

    def enqueue_rollouts(self, rollouts: list[Rollout]) -> list[Rollout]:
        items = [_as(Rollout, r).model_copy(update={"status": RolloutStatus.queued}) for r in rollouts]
        if items:
            with self._write() as c:
                c.execute(schema.rollouts.insert(), [_row(r) for r in items])
        return items

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._one(Rollout, schema.rollouts, R.rollout_id, rollout_id)

    @staticmethod
    def _rollout_filters(
        snapshot_key=None, kind=None, status=None, created_after=None, rollout_ids=None
    ) -> list[sa.ColumnElement[bool]]:
        where = []
        if snapshot_key is not None:
            where.append(R.snapshot_key == snapshot_key)
        if kind is not None:
            where.append(R.kind.in_(_values(RolloutKind, kind)))
        if status is not None:
            where.append(R.status.in_(_values(RolloutStatus, status)))
        if created_after is not None:
            where.append(R.created_at > float(created_after))
        if rollout_ids is not None:
            where.append(R.rollout_id.in_(list(rollout_ids)))
        return where

    def query_rollouts(
        self,
        *,
        snapshot_key: str | None = None,
        kind: RolloutKind | str | Iterable[RolloutKind | str] | None = None,
        status: RolloutStatus | str | Iterable[RolloutStatus | str] | None = None,
        created_after: float | None = None,
        rollout_ids: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        """Oldest first. `kind` and `status` take one value or several."""
        where = self._rollout_filters(snapshot_key, kind, status, created_after, rollout_ids)
        query = sa.select(schema.rollouts).where(*where).order_by(R.id)
        return self._all(Rollout, query if limit is None else query.limit(int(limit)))

    def claim_rollout(
        self,
        worker_id: str,
        *,
        kinds: RolloutKind | str | Iterable[RolloutKind | str] | None = None,
        snapshot_key: str | None = None,
        rollout_ids: Iterable[str] | None = None,
    ) -> tuple[Rollout, Attempt] | None:
        """The oldest queued rollout, with its queued retry attempt (or a new first attempt) now running."""
        where = self._rollout_filters(snapshot_key, kinds, RolloutStatus.queued, None, rollout_ids)
        query = (
            sa.select(schema.rollouts)
            .where(*where)
            .order_by(R.id)
            .limit(1)
            .with_for_update(skip_locked=True, key_share=True)  # PostgreSQL; SQLite: BEGIN IMMEDIATE
        )
        with self._write() as c:
            row = c.execute(query).first()
            if row is None:
                return None
            latest = self._latest_attempt(c, row.rollout_id)
            if latest is not None and latest.state == AttemptState.queued.value:
                attempt = self._move(c, latest, AttemptState.running, {"worker_id": worker_id})
            else:
                t = now()
                attempt = Attempt(
                    rollout_id=row.rollout_id,
                    sequence_id=latest.sequence_id + 1 if latest else 1,
                    state=AttemptState.running,
                    retry_kind=RetryKind.infrastructure if latest else RetryKind.first,
                    worker_id=worker_id,
                    started_at=t,
                    heartbeat_at=t,
                )
                self._add_attempt(c, attempt)
        return _record(Rollout, row).model_copy(update={"status": RolloutStatus.running}), attempt

    def retry_rollout(self, rollout_id: str, retry_kind: RetryKind) -> Attempt:
        """A new queued attempt (sequence + 1) after a finished one; the rollout is queued again."""
        kind = RetryKind(retry_kind)
        if kind is RetryKind.first:
            raise InvalidInput("retry_kind 'first' belongs to a rollout's first attempt")
        with self._write() as c:
            self._lock_rollout(c, rollout_id)
            latest = self._latest_attempt(c, rollout_id)
            if latest is None or AttemptState(latest.state) not in TERMINAL_ATTEMPT_STATES:
                state = latest.state if latest else "no attempt"
                raise Conflict(f"rollout {rollout_id!r}: cannot retry while its latest attempt is {state}")
            attempt = Attempt(rollout_id=rollout_id, sequence_id=latest.sequence_id + 1, retry_kind=kind)
            self._add_attempt(c, attempt)
        return attempt

    def start_attempt(self, attempt_id: str, worker_id: str) -> Attempt:
        with self._write() as c:
            row = self._lock_attempt(c, attempt_id)
            return self._move(c, row, AttemptState.running, {"worker_id": worker_id})

    def transition_attempt(
        self,
        attempt_id: str,
        target: AttemptState,
        *,
        reason_code: str | None = None,
        reason_message: str | None = None,
    ) -> Attempt:
        """Move along the state machine or raise IllegalTransition with nothing changed."""
        target = AttemptState(target)
        values = {"reason_code": reason_code, "reason_message": reason_message}
        with self._write() as c:
            row = self._lock_attempt(c, attempt_id)
            return self._move(c, row, target, {k: v for k, v in values.items() if v is not None})

    def finish_rollout(self, rollout_id: str, status: RolloutStatus) -> None:
        """Set a final status directly (e.g. cancelled, or failed once the runner stops retrying)."""
        status = RolloutStatus(status)
        if status not in FINAL_ROLLOUT_STATUSES:
            raise InvalidInput(f"finish_rollout takes a final status, not {status.value!r}")
        with self._write() as c:
            done = c.execute(
                sa.update(schema.rollouts).where(R.rollout_id == rollout_id).values(status=status.value)
            )
            if done.rowcount == 0:
                raise NotFound(f"rollout {rollout_id!r} not found")

    def heartbeat(self, attempt_id: str) -> None:
        with self._write() as c:
            done = c.execute(
                sa.update(schema.attempts).where(A.attempt_id == attempt_id).values(heartbeat_at=now())
            )
            if done.rowcount == 0:
                raise NotFound(f"attempt {attempt_id!r} not found")

    def get_attempt(self, attempt_id: str) -> Attempt:
        return self._one(Attempt, schema.attempts, A.attempt_id, attempt_id)

    def list_attempts(
        self,
        *,
        rollout_id: str | None = None,
        rollout_ids: Iterable[str] | None = None,
        state: AttemptState | str | Iterable[AttemptState | str] | None = None,
    ) -> list[Attempt]:
        """In creation order. `state` (an addition to the contract) takes one state or several."""
        query = sa.select(schema.attempts).order_by(A.id)
        if rollout_id is not None:
            query = query.where(A.rollout_id == rollout_id)
        if rollout_ids is not None:
            query = query.where(A.rollout_id.in_(list(rollout_ids)))
        if state is not None:
            query = query.where(A.state.in_(_values(AttemptState, state)))
        return self._all(Attempt, query)

    def get_or_create_serve_rollout(self, session: str, resource_id: str | None) -> tuple[Rollout, Attempt]:
        """One `serve` rollout per client session with a running attempt; concurrent first calls agree."""
        session = _text("session", session)
        found = self._serve_rollout(session)
        if found is not None:
            return found
        t = now()
        rollout = Rollout(
            kind=RolloutKind.serve,
            resource_id=resource_id,
            status=RolloutStatus.running,
            metadata={"session": session},
        )
        attempt = Attempt(
            rollout_id=rollout.rollout_id,
            state=AttemptState.running,
            worker_id="serve",
            started_at=t,
            heartbeat_at=t,
        )
        try:
            with self._write() as c:
                c.execute(schema.rollouts.insert(), {**_row(rollout), "session": session})
                c.execute(schema.attempts.insert(), _row(attempt))
            return rollout, attempt
        except Conflict:
            found = self._serve_rollout(session)  # another caller created it first
            if found is None:
                raise
            return found

    def _serve_rollout(self, session: str) -> tuple[Rollout, Attempt] | None:
        with self.engine.connect() as c:
            row = c.execute(sa.select(schema.rollouts).where(R.session == session)).first()
            if row is None:
                return None
            return _record(Rollout, row), _record(Attempt, self._latest_attempt(c, row.rollout_id))

    # attempt helpers: locks are always taken rollout first, then attempt, so no two transactions wait on
    # each other in opposite orders (PostgreSQL would abort one as a deadlock).

    @staticmethod
    def _lock_rollout(c: sa.Connection, rollout_id: str) -> None:
        query = sa.select(R.id).where(R.rollout_id == rollout_id).with_for_update(key_share=True)
        if c.execute(query).first() is None:
            raise NotFound(f"rollout {rollout_id!r} not found")

    def _lock_attempt(self, c: sa.Connection, attempt_id: str) -> sa.Row:
        rollout_id = c.execute(sa.select(A.rollout_id).where(A.attempt_id == attempt_id)).scalar()
        if rollout_id is None:
            raise NotFound(f"attempt {attempt_id!r} not found")
        self._lock_rollout(c, rollout_id)
        query = sa.select(schema.attempts).where(A.attempt_id == attempt_id)
        return c.execute(query.with_for_update(key_share=True)).one()

    @staticmethod
    def _latest_attempt(c: sa.Connection, rollout_id: str, *, lock: bool = True) -> sa.Row | None:
        query = sa.select(schema.attempts).where(A.rollout_id == rollout_id).order_by(A.sequence_id.desc())
        query = query.limit(1)
        return c.execute(query.with_for_update(key_share=True) if lock else query).first()

    @staticmethod
    def _follow(c: sa.Connection, rollout_id: str, sequence_id: int, state: AttemptState) -> None:
        """The rollout's status follows its latest attempt; a late move of an older attempt does not."""
        latest = c.execute(sa.select(sa.func.max(A.sequence_id)).where(A.rollout_id == rollout_id)).scalar()
        if latest == sequence_id:
            status = ROLLOUT_STATUS_OF[state].value
            c.execute(sa.update(schema.rollouts).where(R.rollout_id == rollout_id).values(status=status))

    def _add_attempt(self, c: sa.Connection, attempt: Attempt) -> None:
        c.execute(schema.attempts.insert(), _row(attempt))
        self._follow(c, attempt.rollout_id, attempt.sequence_id, attempt.state)

    def _move(self, c: sa.Connection, row: sa.Row, target: AttemptState, values: dict[str, Any]) -> Attempt:
        check_transition(row.attempt_id, AttemptState(row.state), target)
        t = now()
        values = {**values, "state": target.value}
        if target is AttemptState.running:
            values.update(started_at=t, heartbeat_at=t)
        if target in TERMINAL_ATTEMPT_STATES:
            values["ended_at"] = t
        c.execute(sa.update(schema.attempts).where(A.id == row.id).values(values))
        self._follow(c, row.rollout_id, row.sequence_id, target)
        return Attempt.model_validate({**{k: row._mapping[k] for k in Attempt.model_fields}, **values})

    @staticmethod
    def _check_attempts(c: sa.Connection, pairs: set[tuple[str, str | None]]) -> dict[str, str | None]:
        """Each (rollout_id, attempt_id) names a stored rollout and, if given, one of its attempts.

        One query; returns attempt_id -> span_id of the attempt's newest token-bearing span (or None)."""
        newest = (
            sa.select(S.span_id)
            .where(S.attempt_id == A.attempt_id, S.prompt_tail.is_not(None))
            .order_by(S.id.desc())
            .limit(1)
            .scalar_subquery()
        )
        attempt_ids = sorted({a for _, a in pairs if a is not None})
        query = sa.select(A.attempt_id, A.rollout_id, newest).where(A.attempt_id.in_(attempt_ids))
        owners = {a: (r, span) for a, r, span in c.execute(query)} if attempt_ids else {}
        bare = sorted({r for r, a in pairs if a is None})  # rollouts named without an attempt
        known = (
            set(c.execute(sa.select(R.rollout_id).where(R.rollout_id.in_(bare))).scalars()) if bare else set()
        )
        for rollout_id, attempt_id in sorted(pairs, key=str):
            if attempt_id is None and rollout_id not in known:
                raise NotFound(f"rollout {rollout_id!r} not found")
            if attempt_id is not None and owners.get(attempt_id, (None,))[0] != rollout_id:
                raise NotFound(f"attempt {attempt_id!r} of rollout {rollout_id!r} not found")
        return {a: span for a, (_, span) in owners.items()}

    # -- spans -------------------------------------------------------------------------------------------

    def add_spans(self, spans: list[Span], *, sync: bool = True) -> None:
        """Insert a batch in one transaction (executemany); all or nothing.

        Token storage: an LLM span's prompt is kept as (the attempt's previous LLM span, the length of the
        prefix it shares with that span's prompt + response) plus the remaining ids; ids are packed int32
        and logprobs packed float32 (exact for the float32 values engines produce; see `tokens`).

        `sync=False` (an addition to the contract): the commit survives a crash of this process but is
        flushed to disk only by the next synced commit or checkpoint (SQLite `synchronous=NORMAL`,
        PostgreSQL `synchronous_commit=off`); about 1 ms less CPU per commit on SQLite.
        """
        self._add_spans(spans, sync, nowait=False)

    def try_add_spans(self, spans: list[Span], *, sync: bool = True) -> bool:
        """`add_spans` if it can run at once without blocking (an addition to the contract): on a SQLite
        file, for attempts this Store has written before, when no other writer holds the lock. Returns
        False, having written nothing, otherwise (PostgreSQL, lookups needed, lock taken, or a WAL
        checkpoint due, which the blocking `add_spans` does). Raises what `add_spans` raises."""
        return self._add_spans(spans, sync, nowait=True)

    def _add_spans(self, spans: list[Span], sync: bool, nowait: bool) -> bool:
        items = [_as(Span, s) for s in spans]
        if not items:
            return True
        pairs = {(s.rollout_id, s.attempt_id) for s in items}
        with self._contexts_lock:
            unknown = {p for p in pairs if p not in self._known}
            # attempt_id -> (span_id, packed prompt + response) of its newest LLM span, stored or in batch
            last = {
                s.attempt_id: self._contexts[s.attempt_id] for s in items if s.attempt_id in self._contexts
            }
        uncached = {(s.rollout_id, s.attempt_id) for s in items if s.prompt_token_ids is not None}
        uncached = {p for p in uncached if p[1] not in last}
        raw = self._raw_path is not None and not unknown and not uncached
        if nowait and (not raw or self._raw_sqlite(True)[1]["commits"] % _NOWAIT_CHECKPOINT_EVERY == 0):
            if raw:  # count it, so the caller's next nowait attempt goes ahead
                self._raw_sqlite(True)[1]["commits"] += 1
            return False
        if raw:
            if not self._insert_spans_raw([self._span_row(s, last) for s in items], sync, nowait):
                return False
        else:
            with self._write(sync=sync) as c:
                if unknown or uncached:
                    newest = self._check_attempts(c, unknown | uncached)
                    need = {a: newest[a] for _, a in uncached if newest.get(a) is not None}
                    last.update(self._contexts_of(c, need))
                self._insert_spans(c, [self._span_row(s, last) for s in items])
        with self._contexts_lock:  # remember each attempt's newest context for its next batch
            for attempt_id, entry in last.items():
                self._contexts[attempt_id] = entry
                self._contexts.move_to_end(attempt_id)
            while len(self._contexts) > _CONTEXT_CACHE_SIZE:
                self._contexts.popitem(last=False)
            for pair in unknown:
                self._known[pair] = None
            while len(self._known) > _KNOWN_PAIRS_SIZE:
                self._known.popitem(last=False)
        return True

    @staticmethod
    def _insert_spans(c: sa.Connection, rows: list[dict[str, Any]]) -> None:
        if c.dialect.name != "sqlite":
            c.execute(schema.spans.insert(), rows)  # psycopg2: batched multi-row VALUES (insertmanyvalues)
            return
        # SQLAlchemy's per-row parameter processing costs twice the SQLite insert itself (38 against 13 us
        # per span); sqlite3 takes plain tuples. Same columns and JSON text as the Core path writes.
        c.exec_driver_sql(_SQLITE_SPAN_INSERT, _span_params(rows))

    @staticmethod
    def _span_row(s: Span, last: dict[str, tuple[str, bytes] | None]) -> dict[str, Any]:
        row: dict[str, Any] = {f: getattr(s, f) for f in _SPAN_SCALARS}
        row["kind"] = s.kind.value
        response = s.response_token_ids
        row["response_ids"] = None if response is None else pack_ids(response)
        row["response_logprobs"] = None if s.response_logprobs is None else pack_logprobs(s.response_logprobs)
        prompt = s.prompt_token_ids
        if prompt is None:
            row.update(prompt_ref=None, prompt_shared=None, prompt_tail=None)
            return row
        packed = pack_ids(prompt)
        previous = last.get(s.attempt_id)
        # Compare packed bytes (C speed, nothing unpacked): a shared byte prefix of 4k..4k+3 bytes is k ids.
        shared = shared_prefix(packed, previous[1]) // 4 if previous else 0
        row.update(
            prompt_ref=previous[0] if shared else None,
            prompt_shared=shared,
            prompt_tail=packed[4 * shared :],
        )
        last[s.attempt_id] = (s.span_id, packed + (row["response_ids"] or b""))
        return row

    def _contexts_of(self, c: sa.Connection, newest: dict[str, str]) -> dict[str, tuple[str, bytes]]:
        """attempt_id -> (span_id, its packed prompt + response ids) for the given newest span of each
        attempt, rebuilt from the stored chain (another process wrote them, or the cache forgot)."""
        if not newest:
            return {}
        prompts, tokens = self._resolve(c, S.attempt_id.in_(sorted(newest)))
        return {a: (s, prompts[s] + (tokens[s][3] or b"")) for a, s in newest.items()}

    @staticmethod
    def _resolve(
        c: sa.Connection, where: sa.ColumnElement[bool] | None, tokens: dict[str, tuple] | None = None
    ) -> tuple[dict[str, bytes], dict[str, tuple]]:
        """Packed prompts of the token spans selected by `where` (or given as `tokens`: span_id ->
        (prompt_ref, prompt_shared, prompt_tail, response_ids)), fetching referenced spans as needed."""
        cols = (S.span_id, S.prompt_ref, S.prompt_shared, S.prompt_tail, S.response_ids)

        def fetch(clause: sa.ColumnElement[bool]) -> dict[str, tuple]:
            query = sa.select(*cols).where(clause, S.prompt_tail.is_not(None))
            return {
                r[0]: (r[1], r[2], bytes(r[3]), None if r[4] is None else bytes(r[4]))
                for r in c.execute(query)
            }

        tokens = dict(tokens or {})
        if where is not None:
            tokens.update(fetch(where))
        while missing := {t[0] for t in tokens.values() if t[0] is not None and t[0] not in tokens}:
            tokens.update(fetch(S.span_id.in_(sorted(missing))))
        prompts: dict[str, bytes] = {}
        for span_id in tokens:
            chain = []
            while span_id is not None and span_id not in prompts:  # walk back to a known or first prompt
                chain.append(span_id)
                span_id = tokens[span_id][0]
            for sid in reversed(chain):
                ref, shared, tail, _ = tokens[sid]
                head = b""
                if ref is not None:
                    head = (prompts[ref] + (tokens[ref][3] or b""))[: 4 * shared]
                prompts[sid] = head + tail
        return prompts, tokens

    @staticmethod
    def _span_filters(rollout_id=None, attempt_id=None, rollout_ids=None, kind=None) -> list:
        where = []
        if rollout_id is not None:
            where.append(S.rollout_id == rollout_id)
        if attempt_id is not None:
            where.append(S.attempt_id == attempt_id)
        if rollout_ids is not None:
            where.append(S.rollout_id.in_(list(rollout_ids)))
        if kind is not None:
            where.append(S.kind.in_(_values(SpanKind, kind)))
        return where

    def list_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        rollout_ids: Iterable[str] | None = None,
        kind: SpanKind | str | Iterable[SpanKind | str] | None = None,
    ) -> list[Span]:
        """Ordered by attempt (creation order), then sequence, then insertion; token fields exact."""
        query = (
            sa.select(schema.spans)
            .join(schema.attempts, A.attempt_id == S.attempt_id)
            .where(*self._span_filters(rollout_id, attempt_id, rollout_ids, kind))
            .order_by(A.id, S.sequence, S.id)
        )
        with self.engine.connect() as c:
            rows = c.execute(query).all()
            tokens = {
                r.span_id: (
                    r.prompt_ref,
                    r.prompt_shared,
                    bytes(r.prompt_tail),
                    r.response_ids and bytes(r.response_ids),
                )
                for r in rows
                if r.prompt_tail is not None
            }
            prompts, _ = self._resolve(c, None, tokens)
        out = []
        for r in rows:
            m = r._mapping
            fields = {k: m[k] for k in _SPAN_SCALARS}
            fields["prompt_token_ids"] = unpack_ids(prompts[r.span_id]) if r.prompt_tail is not None else None
            fields["response_token_ids"] = (
                None if r.response_ids is None else unpack_ids(bytes(r.response_ids))
            )
            lp = r.response_logprobs
            fields["response_logprobs"] = None if lp is None else unpack_logprobs(bytes(lp))
            fields["kind"] = SpanKind(fields["kind"])
            # validated when written; re-validating 1k-id lists would double the cost of reading
            out.append(Span.model_construct(**fields))
        return out

    def count_spans(
        self,
        *,
        rollout_ids: Iterable[str] | None = None,
        kind: SpanKind | str | Iterable[SpanKind | str] | None = None,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
    ) -> int:
        where = self._span_filters(rollout_id, attempt_id, rollout_ids, kind)
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.count()).select_from(schema.spans).where(*where)).scalar_one()

    def attempt_facts(self, attempt_id: str) -> tuple[str, AttemptState, RolloutKind, dict, int | None]:
        """(rollout id, state, rollout kind, rollout metadata, highest span sequence or None) of an attempt
        in one read: what a gateway needs to start serving it (an addition to the contract)."""
        top = sa.select(sa.func.max(S.sequence)).where(S.attempt_id == attempt_id).scalar_subquery()
        query = (
            sa.select(A.rollout_id, A.state, R.kind, R.metadata, top)
            .join(schema.rollouts, R.rollout_id == A.rollout_id)
            .where(A.attempt_id == attempt_id)
        )
        with self.engine.connect() as c:
            row = c.execute(query).first()
        if row is None:
            raise NotFound(f"attempt {attempt_id!r} not found")
        with self._contexts_lock:  # the pair is now checked; an attempt without spans has no context yet
            self._known[(row[0], attempt_id)] = None
            if row[4] is None:
                self._contexts.setdefault(attempt_id, None)
        return row[0], AttemptState(row[1]), RolloutKind(row[2]), row[3] or {}, row[4]

    def max_span_sequence(self, attempt_id: str) -> int | None:
        """The highest span sequence recorded for an attempt (None if none): the next recorder's start,
        without reconstructing any token arrays."""
        with self.engine.connect() as c:
            return c.execute(sa.select(sa.func.max(S.sequence)).where(S.attempt_id == attempt_id)).scalar()

    # -- rewards -----------------------------------------------------------------------------------------

    def add_reward(self, r: Reward) -> None:
        r = _as(Reward, r)
        with self._write() as c:
            self._check_attempts(c, {(r.rollout_id, r.attempt_id)})
            c.execute(schema.rewards.insert(), _row(r))

    def list_rewards(
        self, *, rollout_ids: Iterable[str] | None = None, rollout_id: str | None = None
    ) -> list[Reward]:
        """In arrival order."""
        c_ = schema.rewards.c
        query = sa.select(schema.rewards).order_by(c_.id)
        if rollout_ids is not None:
            query = query.where(c_.rollout_id.in_(list(rollout_ids)))
        if rollout_id is not None:
            query = query.where(c_.rollout_id == rollout_id)
        return self._all(Reward, query)

    # -- append-only documents ---------------------------------------------------------------------------

    def append_document(
        self, collection: str, doc_id: str, content_hash: str, body: dict, previous_hash: str | None
    ) -> int:
        """Append version n+1 whose `previous_hash` must equal version n's content hash (None for the
        first version); otherwise Conflict. Returns the new version number."""
        d = schema.documents.c
        for name, value in (("collection", collection), ("doc_id", doc_id), ("content_hash", content_hash)):
            _text(name, value)
        if not isinstance(body, dict):
            raise InvalidInput(f"document body must be a dict, got {type(body).__name__}")
        with self._write() as c:
            head = c.execute(
                sa.select(d.version, d.content_hash)
                .where(d.collection == collection, d.doc_id == doc_id)
                .order_by(d.version.desc())
                .limit(1)
                .with_for_update(key_share=True)
            ).first()
            head_hash = head.content_hash if head else None
            if previous_hash != head_hash:
                raise Conflict(
                    f"document {collection}/{doc_id}: previous_hash {previous_hash!r} is not the head {head_hash!r}"
                )
            version = head.version + 1 if head else 1
            row = {
                "collection": collection,
                "doc_id": doc_id,
                "version": version,
                "content_hash": content_hash,
            }
            c.execute(
                schema.documents.insert(),
                {**row, "previous_hash": previous_hash, "body": body, "created_at": now()},
            )
        return version

    def document_versions(self, collection: str, doc_id: str) -> list[StoredDocument]:
        d = schema.documents.c
        query = sa.select(schema.documents).where(d.collection == collection, d.doc_id == doc_id)
        return self._all(StoredDocument, query.order_by(d.version))

    # -- pointers ----------------------------------------------------------------------------------------

    def move_pointer(
        self,
        name: str,
        *,
        expected: str | None,
        to: str,
        actor: str,
        receipt_id: str | None = None,
        note: str = "",
    ) -> PointerMove:
        """Compare-and-set under a row lock: moves only if the current value equals `expected` (None: the
        pointer was never set), else PointerConflict(name, expected, actual). Every move is kept."""
        for field, value in (("name", name), ("to", to), ("actor", actor)):
            _text(field, value)
        p = schema.pointers.c
        try:
            with self._write() as c:
                row = c.execute(
                    sa.select(schema.pointers).where(p.name == name).with_for_update(key_share=True)
                ).first()
                actual = row.value if row else None
                if actual != expected:
                    raise PointerConflict(name, expected, actual)
                move = PointerMove(
                    name=name,
                    from_value=actual,
                    to_value=to,
                    actor=actor,
                    receipt_id=receipt_id,
                    note=note,
                    moved_at=now(),
                    seq=row.seq + 1 if row else 1,
                )
                state = {"value": to, "seq": move.seq, "updated_at": move.moved_at}
                if row:
                    c.execute(sa.update(schema.pointers).where(p.name == name).values(state))
                else:  # a concurrent first move fails on the primary key and becomes a PointerConflict
                    c.execute(schema.pointers.insert(), {"name": name, **state})
                c.execute(schema.pointer_moves.insert(), move.model_dump())
        except PointerConflict:
            raise
        except Conflict as exc:
            raise PointerConflict(name, expected, self.current_pointer(name)) from exc
        return move

    def current_pointer(self, name: str) -> str | None:
        """One primary-key read of the pointer row (the history is not touched)."""
        with self.engine.connect() as c:
            return c.execute(
                sa.select(schema.pointers.c.value).where(schema.pointers.c.name == name)
            ).scalar()

    def pointer_history(self, name: str, *, last: int | None = None) -> list[PointerMove]:
        """Every move, oldest first; with `last`, only the newest `last` moves (still oldest first), read
        backwards through the (name, seq) unique index."""
        m = schema.pointer_moves.c
        query = sa.select(schema.pointer_moves).where(m.name == name)
        if last is None:
            return self._all(PointerMove, query.order_by(m.seq))
        if isinstance(last, bool) or not isinstance(last, int) or last < 0:
            raise InvalidInput(f"last must be a non-negative integer, got {last!r}")
        return self._all(PointerMove, query.order_by(m.seq.desc()).limit(last))[::-1]

    # -- flags -------------------------------------------------------------------------------------------

    def set_flag(self, key: str, value: dict) -> None:
        _text("key", key)
        if not isinstance(value, dict):
            raise InvalidInput(f"flag value must be a dict, got {type(value).__name__}")
        with self._write() as c:
            dialect = postgresql if c.dialect.name == "postgresql" else sqlite
            insert = dialect.insert(schema.flags).values(key=key, value=value, updated_at=now())
            fresh = {"value": insert.excluded.value, "updated_at": insert.excluded.updated_at}
            c.execute(insert.on_conflict_do_update(index_elements=["key"], set_=fresh))

    def get_flag(self, key: str) -> dict | None:
        with self.engine.connect() as c:
            return c.execute(sa.select(schema.flags.c.value).where(schema.flags.c.key == key)).scalar()
