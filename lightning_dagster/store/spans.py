"""Spans and rewards: batch span ingest with packed, prefix-shared token arrays (see `tokens`), the gateway's
non-blocking SQLite write, span reads that rebuild exact token arrays, rewards, and attempt facts."""

from __future__ import annotations

import contextlib
import operator
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import sqlalchemy as sa
from cachetools import LRUCache

from lightning_dagster.store import schema
from lightning_dagster.store.connection import (
    Connection,
    as_record,
    checked,
    dump_json,
    enum_values,
    to_row,
    unavailable,
)
from lightning_dagster.store.errors import Conflict, InvalidInput, NotFound
from lightning_dagster.store.tokens import pack_ids, pack_logprobs, shared_prefix, unpack_ids, unpack_logprobs
from lightning_dagster.types import AttemptState, Reward, RolloutKind, Span, SpanKind

R, A, S = schema.rollouts.c, schema.attempts.c, schema.spans.c
_TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids", "response_logprobs")
_SPAN_SCALARS = tuple(f for f in Span.model_fields if f not in _TOKEN_FIELDS)
_SPAN_COLUMNS = tuple(col.name for col in schema.spans.c if col.name != "id")
_SQLITE_SPAN_INSERT = (
    f"INSERT INTO spans ({', '.join(_SPAN_COLUMNS)}) VALUES ({', '.join('?' * len(_SPAN_COLUMNS))})"
)
_CONTEXT_CACHE_SIZE = 2048  # attempts whose newest prompt+response is kept packed (~4-8 KB each)
# Every 64th nowait write defers to a blocking writer, which checkpoints: an ever-growing WAL costs every
# append more CPU (a create 0.24 -> 0.17 ms with the WAL kept bounded, creates 1 ms apart).
_NOWAIT_CHECKPOINT_EVERY = 64
_KNOWN_PAIRS_SIZE = 65536  # (rollout, attempt) pairs already checked: an attempt never changes rollout


_SPAN_VALUES = operator.itemgetter(*_SPAN_COLUMNS)
_ATTRIBUTES = _SPAN_COLUMNS.index("attributes")


def _span_params(rows: list[dict[str, Any]]) -> list[tuple]:
    """Each row's values in `_SPAN_COLUMNS` order, its attributes as JSON text."""
    params = []
    for row in rows:
        values = list(_SPAN_VALUES(row))
        values[_ATTRIBUTES] = dump_json(values[_ATTRIBUTES])
        params.append(tuple(values))
    return params


def _token_entry(ref: str | None, shared: int | None, tail: Any, response: Any) -> tuple:
    """A token span's stored (prompt_ref, prompt_shared, prompt_tail, response_ids), as bytes."""
    return ref, shared, bytes(tail), None if response is None else bytes(response)


class SpanStore(Connection):
    def _open_spans(self) -> None:
        """The span write caches and, on a SQLite file, the plain-sqlite3 write path (after `_connect`)."""
        # attempt_id -> (span_id, packed prompt + response) of its newest LLM span written here (None: no
        # spans yet). A stale entry (another process wrote newer spans) only makes storage less compact.
        self._contexts: LRUCache[str, tuple[str, bytes] | None] = LRUCache(_CONTEXT_CACHE_SIZE)
        self._known: LRUCache[tuple[str, str | None], None] = LRUCache(_KNOWN_PAIRS_SIZE)  # checked pairs
        self._contexts_lock = threading.Lock()
        # SQLite files: batches needing no lookup go through a plain sqlite3 connection per thread
        # (SQLAlchemy's begin/execute/commit costs ~3x the insert and commit themselves).
        u = self.engine.url
        self._raw_path = (
            u.database
            if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:")
            else None
        )
        self._raw_local = threading.local()
        self._raw_conns: list[sqlite3.Connection] = []

    def _close_spans(self) -> None:
        with self._contexts_lock:
            conns, self._raw_conns = self._raw_conns, []
        for conn in conns:
            conn.close()

    def add_spans(self, spans: list[Span], *, sync: bool = True) -> None:
        """Insert a batch in one transaction; a prompt is kept as the prefix it shares with the attempt's
        previous LLM span plus the rest. `sync=False` (an addition): on disk only with the next synced
        commit (`synchronous=NORMAL`, `synchronous_commit=off`), ~1 ms less CPU per SQLite commit."""
        self._add_spans(spans, sync, nowait=False)

    def try_add_spans(self, spans: list[Span], *, sync: bool = True) -> bool:
        """`add_spans` if it can run without blocking (an addition); else False, nothing written."""
        return self._add_spans(spans, sync, nowait=True)

    def _add_spans(self, spans: list[Span], sync: bool, nowait: bool) -> bool:
        items = [as_record(Span, s) for s in spans]
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
        if nowait and not raw:
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
            self._contexts.update(last)
            self._known.update(dict.fromkeys(unknown))
        return True

    @staticmethod
    def _insert_spans(c: sa.Connection, rows: list[dict[str, Any]]) -> None:
        if c.dialect.name != "sqlite":
            c.execute(schema.spans.insert(), rows)  # psycopg2: batched multi-row VALUES (insertmanyvalues)
            return
        # SQLAlchemy's per-row parameter processing costs twice the insert itself (38 against 13 us a span)
        c.exec_driver_sql(_SQLITE_SPAN_INSERT, _span_params(rows))

    def _raw_sqlite(self, nowait: bool) -> tuple[sqlite3.Connection, dict[str, Any]]:
        """This thread's plain connection and its state; a `nowait` one never waits or checkpoints."""
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
            local[key] = (conn, {"synchronous": None, "commits": 0, "calls": 0})
            with self._contexts_lock:
                self._raw_conns.append(conn)
        return local[key]

    def _insert_spans_raw(self, rows: list[dict[str, Any]], sync: bool, nowait: bool) -> bool:
        """`_insert_spans` in its own `raw_write` transaction; `nowait`: False, nothing written, if locked."""
        params = _span_params(rows)
        with self.raw_write(synchronous=2 if sync else 1, nowait=nowait) as conn:
            if conn is None:
                return False
            conn.executemany(_SQLITE_SPAN_INSERT, params)
        return True

    @property
    def raw_reads(self) -> bool:
        """A SQLite file: hot reads and writes go through plain sqlite3 (`raw_read`, `raw_write`)."""
        return self._raw_path is not None

    def raw_read(self, sql: str, params: Iterable[Any] = ()) -> list[tuple]:
        """One read on this thread's plain connection; a locked or unreadable file raises its named error."""
        conn, _ = self._raw_sqlite(nowait=False)
        try:
            return conn.execute(sql, tuple(params)).fetchall()
        except sqlite3.OperationalError as exc:
            self._raise_named(exc)
            raise

    @contextlib.contextmanager
    def raw_write(self, *, synchronous: int, nowait: bool) -> Iterator[sqlite3.Connection | None]:
        """One `BEGIN IMMEDIATE` transaction on this thread's plain connection at `synchronous` (1: no fsync,
        2: synced), rolled back on any error. `nowait`: None when locked, and every
        `_NOWAIT_CHECKPOINT_EVERY`th call (so a blocking write checkpoints the WAL)."""
        conn, state = self._raw_sqlite(nowait)
        if nowait:
            state["calls"] += 1
            if state["calls"] % _NOWAIT_CHECKPOINT_EVERY == 0:
                yield None
                return
        if state["synchronous"] != synchronous:
            conn.execute(f"PRAGMA synchronous = {int(synchronous)}")
            state["synchronous"] = synchronous
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if nowait and ("locked" in str(exc) or "busy" in str(exc)):
                yield None
                return
            self._raise_named(exc)
            raise
        try:
            yield conn
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.IntegrityError):
                raise Conflict(str(exc).strip()) from exc
            self._raise_named(exc)
            raise
        state["commits"] += 1

    def _raise_named(self, exc: BaseException) -> None:
        """A locked or read-only store as its named error (the plain sqlite3 path has no engine hook)."""
        if isinstance(exc, sqlite3.OperationalError):
            named = unavailable(exc, self._raw_path, self._busy_timeout_s)
            if named is not None:
                raise named from exc

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
            return checked(schema.spans, row)
        packed = pack_ids(prompt)
        previous = last.get(s.attempt_id)
        # Compare packed bytes (C speed, nothing unpacked): a shared byte prefix of 4k..4k+3 bytes is k ids.
        shared = shared_prefix(packed, previous[1]) // 4 if previous else 0
        row.update(
            prompt_ref=previous[0] if shared else None, prompt_shared=shared, prompt_tail=packed[4 * shared :]
        )
        last[s.attempt_id] = (s.span_id, packed + (row["response_ids"] or b""))
        return checked(schema.spans, row)

    def _contexts_of(self, c: sa.Connection, newest: dict[str, str]) -> dict[str, tuple[str, bytes]]:
        """attempt_id -> (span_id, packed prompt + response) of each newest span given, from the chain."""
        if not newest:
            return {}
        prompts, tokens = self._resolve(c, S.attempt_id.in_(sorted(newest)))
        return {a: (s, prompts[s] + (tokens[s][3] or b"")) for a, s in newest.items()}

    @staticmethod
    def _check_attempts(c: sa.Connection, pairs: set[tuple[str, str | None]]) -> dict[str, str | None]:
        """Check each (rollout_id, attempt_id) is stored; attempt_id -> its newest token span id (or None)."""
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

    @staticmethod
    def _resolve(
        c: sa.Connection, where: sa.ColumnElement[bool] | None, tokens: dict[str, tuple] | None = None
    ) -> tuple[dict[str, bytes], dict[str, tuple]]:
        """Packed prompts of the token spans `where` selects (or in `tokens`), fetching referenced spans."""
        cols = (S.span_id, S.prompt_ref, S.prompt_shared, S.prompt_tail, S.response_ids)

        def fetch(clause: sa.ColumnElement[bool]) -> dict[str, tuple]:
            query = sa.select(*cols).where(clause, S.prompt_tail.is_not(None))
            return {r[0]: _token_entry(*r[1:]) for r in c.execute(query)}

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
            where.append(S.kind.in_(enum_values(SpanKind, kind)))
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
                r.span_id: _token_entry(r.prompt_ref, r.prompt_shared, r.prompt_tail, r.response_ids)
                for r in rows
                if r.prompt_tail is not None
            }
            prompts, _ = self._resolve(c, None, tokens)
        out = []
        for r in rows:
            m = r._mapping
            fields = {k: m[k] for k in _SPAN_SCALARS}
            fields["prompt_token_ids"] = unpack_ids(prompts[r.span_id]) if r.prompt_tail is not None else None
            ids, lp = r.response_ids, r.response_logprobs
            fields["response_token_ids"] = None if ids is None else unpack_ids(bytes(ids))
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

    def attempt_facts(
        self, attempt_id: str
    ) -> tuple[str, AttemptState, RolloutKind, dict, int | None, str | None]:
        """What a gateway needs to serve an attempt, in one read (an addition)."""
        top = sa.select(sa.func.max(S.sequence)).where(S.attempt_id == attempt_id).scalar_subquery()
        query = (
            sa.select(A.rollout_id, A.state, R.kind, R.metadata, top, R.harness)
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
        return row[0], AttemptState(row[1]), RolloutKind(row[2]), row[3] or {}, row[4], row[5]

    def add_reward(self, r: Reward, *, span: Span | None = None, request_id: str | None = None) -> str | None:
        """Store a reward and its span (an addition); with `request_id`, a retry stores nothing new."""
        r = as_record(Reward, r)
        span = None if span is None else as_record(Span, span)
        if span is not None and (span.rollout_id, span.attempt_id) != (r.rollout_id, r.attempt_id):
            raise InvalidInput("the reward's span must belong to the reward's attempt")
        row = {**to_row(r), "request_id": request_id, "span_id": span and span.span_id}
        checked(schema.rewards, row)
        span_row = None if span is None else self._span_row(span, {})
        try:
            with self._write() as c:
                if request_id is not None and (stored := self._replayed(c, r, request_id)) is not None:
                    return stored.span_id
                self._check_attempts(c, {(r.rollout_id, r.attempt_id)})
                c.execute(schema.rewards.insert(), row)
                if span_row is not None:
                    self._insert_spans(c, [span_row])
        except Conflict:
            if request_id is None:
                raise
            with self.engine.connect() as c:  # a concurrent retry of the same request committed first
                stored = self._replayed(c, r, request_id)
            if stored is None:
                raise
            return stored.span_id
        return row["span_id"]

    @staticmethod
    def _replayed(c: sa.Connection, r: Reward, request_id: str) -> sa.Row | None:
        """The reward this request already stored, if any (another reward under its id: Conflict)."""
        W = schema.rewards.c
        found = c.execute(
            sa.select(W.span_id, W.attempt_id, W.value, W.judge, W.judge_version).where(
                W.rollout_id == r.rollout_id, W.request_id == request_id
            )
        ).first()
        if found is not None and tuple(found[1:]) != (r.attempt_id, r.value, r.judge, r.judge_version):
            raise Conflict(
                f"request id {request_id!r} already stored another reward of rollout {r.rollout_id!r}"
            )
        return found

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
