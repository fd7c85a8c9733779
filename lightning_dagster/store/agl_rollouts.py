"""The store side of the Agent Lightning v1.0 server surface: rollouts created through its REST API
(`harness="agl"`, `task = {"input": ...}`, the rest in `metadata["agl"]`), their lifecycle moves, and the
completion log its terminal page reads. An attempt is named by its sequence ("0" first)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import pydantic_core
import sqlalchemy as sa

from lightning_dagster.store import schema
from lightning_dagster.store.connection import checked, dump_json, from_row, to_row
from lightning_dagster.store.errors import Conflict, NotFound
from lightning_dagster.types import (
    Attempt,
    AttemptState,
    Rollout,
    RolloutKind,
    RolloutStatus,
    check_transition,
    now,
)

R, A = schema.rollouts.c, schema.attempts.c
HARNESS = "agl"
DELETED = "agl-deleted"  # deleted through the API: hidden from it, kept for lineage
TERMINAL_COUNTER = "agl.terminal_seq"

AGL_STATE = {"queued": "queuing", "running": "running", "succeeded": "succeeded", "failed": "failed",
             "cancelled": "failed"}  # fmt: skip
OUR_STATUS = {"queuing": [RolloutStatus.queued], "running": [RolloutStatus.running],
              "succeeded": [RolloutStatus.succeeded],
              "failed": [RolloutStatus.failed, RolloutStatus.cancelled]}  # fmt: skip
# Agent Lightning's lifecycle: terminal states have no way out, and a rollout never goes back to queuing.
AGL_MOVES = {"queuing": {"running", "failed"}, "running": {"succeeded", "failed"}}


class IllegalMove(Conflict):
    """A lifecycle move Agent Lightning's state machine does not have (409)."""


class AglRow(NamedTuple):
    """What the API shows of a rollout (a plain sqlite3 read costs a tenth of SQLAlchemy plus pydantic)."""

    rollout_id: str
    status: str  # ours
    task: dict
    metadata: dict
    created_at: float
    task_id: str

    @classmethod
    def of(cls, r: Rollout) -> AglRow:
        return cls(r.rollout_id, r.status.value, r.task, r.metadata, r.created_at, r.task_id)


_COLUMNS = (R.rollout_id, R.status, R.task, R.metadata, R.created_at, R.task_id)
_COLUMNS_SQL = "rollout_id, status, task, metadata, created_at, task_id"
_SELECT = f"SELECT {_COLUMNS_SQL} FROM rollouts WHERE "


def _raw_row(r: tuple) -> AglRow:
    """An `AglRow` of a plain sqlite3 row (`_SELECT`'s columns; JSON as text)."""
    return AglRow(r[0], r[1], pydantic_core.from_json(r[2]), pydantic_core.from_json(r[3]), r[4], r[5])


def _read(store, where_sql: str, params: tuple, where: Callable[[], list]) -> list[AglRow]:
    """Rows matching `where_sql` (SQLite file, plain sqlite3) or `where()` (SQLAlchemy, any store)."""
    if store.raw_reads:
        return [_raw_row(r) for r in store.raw_read(_SELECT + where_sql, params)]
    query = sa.select(*_COLUMNS).where(*where())
    with store.engine.connect() as c:
        return [AglRow(*row) for row in c.execute(query)]


def create(store, rollouts: list[Rollout], *, nowait: bool = False) -> list[AglRow] | None:
    """Insert the rollouts whose id is new (an existing id: the stored one); `nowait`: None if locked."""
    ids = [r.rollout_id for r in rollouts]
    if store.raw_reads:
        return _create_raw(store, rollouts, ids, nowait)
    if nowait:
        return None
    # Two clients creating one new id at once: the second insert's unique violation, done again, finds it.
    tries = 0
    while True:
        try:
            with store._write() as c:
                rows = c.execute(sa.select(*_COLUMNS, R.harness).where(R.rollout_id.in_(ids))).all()
                out, fresh, retired = _plan(rollouts, {row[0]: (row[-1], AglRow(*row[:-1])) for row in rows})
                _retire(lambda sql, params: c.execute(sa.text(sql), params), retired)
                if fresh:
                    c.execute(schema.rollouts.insert(), fresh)
            return out
        except Conflict:
            tries += 1
            if tries == 3:  # an id of another API's rollout, or a conflict that does not go away
                raise


def _plan(
    rollouts: list[Rollout], found: dict[str, tuple[str, AglRow]]
) -> tuple[list[AglRow], list[dict], list[str]]:
    """(what to answer, rows to insert, deleted ids to retire first); `found`: id -> (harness, row)."""
    out, fresh, retired = [], [], []
    for r in rollouts:
        if r.rollout_id in found and found[r.rollout_id][0] == DELETED:
            del found[r.rollout_id]  # created again, as Agent Lightning does: the old record is renamed
            retired.append(r.rollout_id)
        if r.rollout_id in found:
            harness, row = found[r.rollout_id]
            if harness != HARNESS:
                raise Conflict(f"rollout_id: {r.rollout_id!r} is taken by a rollout not of this API")
            out.append(row)
        else:
            row = AglRow.of(r)
            found[r.rollout_id] = (HARNESS, row)  # a repeated id within one batch is created once
            fresh.append(checked(schema.rollouts, to_row(r)))
            out.append(row)
    return out, fresh, retired


_ROLLOUT_COLUMNS = ", ".join(c.name for c in schema.rollouts.c if c.name not in ("id", "rollout_id"))
RETIRE = (  # one statement list for SQLAlchemy (`sa.text`) and plain sqlite3 (named parameters alike)
    f"INSERT INTO rollouts (rollout_id, {_ROLLOUT_COLUMNS}) SELECT :tomb, {_ROLLOUT_COLUMNS} FROM rollouts"
    " WHERE rollout_id = :rid",
    *(f"UPDATE {t} SET rollout_id = :tomb WHERE rollout_id = :rid" for t in ("attempts", "spans", "rewards")),
    "DELETE FROM rollouts WHERE rollout_id = :rid",
)


def _retire(execute: Callable[[str, dict], Any], ids: list[str]) -> None:
    """Rename each deleted rollout (and its records) to a tombstone id the API never shows, freeing the id."""
    for rid in ids:
        params = {"rid": rid, "tomb": f"{rid[:39]}~deleted~{uuid.uuid4().hex[:16]}"}  # <= 64 characters
        for sql in RETIRE:
            execute(sql, params)


_INSERTED = [c for c in schema.rollouts.c if c.name != "id"]
_INSERTED_JSON = [(c.name, isinstance(c.type, sa.JSON)) for c in _INSERTED]
_INSERT = f"INSERT INTO rollouts ({', '.join(c.name for c in _INSERTED)}) VALUES ({', '.join('?' * len(_INSERTED))})"


def _create_raw(store, rollouts: list[Rollout], ids: list[str], nowait: bool) -> list[AglRow] | None:
    """`create` on plain sqlite3 (same rows and JSON text), committed without an fsync as LLM spans are."""
    with store.raw_write(synchronous=1, nowait=nowait) as conn:
        if conn is None:
            return None
        sql = f"SELECT {_COLUMNS_SQL}, harness FROM rollouts WHERE rollout_id IN ({','.join('?' * len(ids))})"
        found = {r[0]: (r[6], _raw_row(r)) for r in conn.execute(sql, ids).fetchall()}
        out, fresh, retired = _plan(rollouts, found)
        _retire(conn.execute, retired)
        params = [
            tuple([dump_json(row[name]) if json else row.get(name) for name, json in _INSERTED_JSON])
            for row in fresh
        ]
        conn.executemany(_INSERT, params)
    return out


def get(store, rollout_id: str) -> AglRow:
    found = _read(
        store,
        "rollout_id = ? AND harness = ?",
        (rollout_id, HARNESS),
        lambda: [R.rollout_id == rollout_id, R.harness == HARNESS],
    )
    if not found:
        raise NotFound(f"rollout {rollout_id!r} not found")
    return found[0]


def exists(store, rollout_id: str) -> bool:
    """Whether this API shows the rollout (ours, not deleted)."""
    if store.raw_reads:
        sql = "SELECT 1 FROM rollouts WHERE rollout_id = ? AND harness = ?"
        return bool(store.raw_read(sql, (rollout_id, HARNESS)))
    with store.engine.connect() as c:
        q = sa.select(R.id).where(R.rollout_id == rollout_id, R.harness == HARNESS)
        return c.execute(q).first() is not None


def attempt_ids(store, rollout_id: str) -> list[str]:
    """The rollout's attempts (our ids), oldest first: Agent Lightning's name of each is its index."""
    if store.raw_reads:
        sql = "SELECT attempt_id FROM attempts WHERE rollout_id = ? ORDER BY sequence_id"
        return [r[0] for r in store.raw_read(sql, (rollout_id,))]
    with store.engine.connect() as c:
        return _attempt_ids(c, rollout_id)


def attempt_index(name: str) -> int | None:
    """The sequence an Agent Lightning attempt name gives ("0" -> 0); None: not such a name."""
    return int(name) if name.isdecimal() and name.isascii() and (name == "0" or name[0] != "0") else None


def _attempt_ids(c: sa.Connection, rollout_id: str) -> list[str]:
    q = sa.select(A.attempt_id).where(A.rollout_id == rollout_id).order_by(A.sequence_id)
    return list(c.execute(q).scalars())


def query(store, states: list[str], limit: int) -> list[tuple[str, str, int, float]]:
    """(rollout id, status, version, created_at) of this API's rollouts in the given states, oldest first."""
    statuses = sorted({s.value for state in states for s in OUR_STATUS[state]})
    if store.raw_reads:
        sql = (
            "SELECT rollout_id, status, json_extract(metadata, '$.agl.status.version'), created_at FROM rollouts "
            f"WHERE status IN ({','.join('?' * len(statuses))}) AND harness = ? ORDER BY id LIMIT ?"
        )
        return store.raw_read(sql, (*statuses, HARNESS, limit))
    version = R.metadata[("agl", "status", "version")].as_integer()
    q = sa.select(R.rollout_id, R.status, version, R.created_at).where(
        R.status.in_(statuses), R.harness == HARNESS
    )
    with store.engine.connect() as c:
        return [tuple(row) for row in c.execute(q.order_by(R.id).limit(limit))]


def get_many(store, ids: list[str]) -> list[AglRow]:
    marks = ",".join("?" * len(ids))
    return _read(store, f"rollout_id IN ({marks})", tuple(ids), lambda: [R.rollout_id.in_(ids)])


def span_marker(store, attempt_id: str) -> tuple[int, int | None]:
    """(count, highest sequence) of an attempt's spans: names what a read of them returns (only added)."""
    if store.raw_reads:
        sql = "SELECT count(*), max(sequence) FROM spans WHERE attempt_id = ?"
        return store.raw_read(sql, (attempt_id,))[0]
    S = schema.spans.c
    with store.engine.connect() as c:
        q = sa.select(sa.func.count(), sa.func.max(S.sequence)).where(S.attempt_id == attempt_id)
        return tuple(c.execute(q).one())


def terminal_page(store, after: int, limit: int) -> tuple[list[AglRow], int, int]:
    """Terminal rollouts after `after` in completion order (a deleted one skipped): (rows, next, total)."""
    seq = R.metadata[("agl", "status", "terminal_seq")].as_integer()
    with store.engine.connect() as c:
        total = _counter(c)
        stop = min(after + limit, total)
        q = sa.select(*_COLUMNS).where(R.harness == HARNESS, seq > after, seq <= stop).order_by(seq)
        rows = [AglRow(*row) for row in c.execute(q)]
    return rows, max(stop, after), total


def _counter(c: sa.Connection) -> int:
    value = c.execute(sa.select(schema.flags.c.value).where(schema.flags.c.key == TERMINAL_COUNTER)).scalar()
    return int(value["value"]) if value else 0


def _bump_counter(c: sa.Connection) -> int:
    seq = _counter(c) + 1
    values = {"value": {"value": seq}, "updated_at": now()}
    done = c.execute(sa.update(schema.flags).where(schema.flags.c.key == TERMINAL_COUNTER).values(values))
    if done.rowcount == 0:
        c.execute(schema.flags.insert().values(key=TERMINAL_COUNTER, **values))
    return seq


def move(store, rollout_id: str, fields: dict[str, Any], worker_id: str) -> AglRow:
    """Apply one status patch in one transaction (IllegalMove for a move the lifecycle lacks)."""
    with store._write() as c:
        row = c.execute(
            sa.select(schema.rollouts).where(R.rollout_id == rollout_id).with_for_update(key_share=True)
        ).first()
        if row is None or row.harness != HARNESS:
            raise NotFound(f"rollout {rollout_id!r} not found")
        rollout = from_row(Rollout, row)
        agl = dict(rollout.metadata.get("agl", {}))
        status = {**agl.get("status", {}), **{k: v for k, v in fields.items() if k != "state"}}
        target = fields.get("state")
        if target is not None:
            status["terminal_seq"] = _step(store, c, rollout, target, worker_id, status.get("error_message"))
            rollout.status = OUR_STATUS[target][0]
        status["version"] = int(status.get("version", 1)) + 1
        status["updated_at"] = now()
        status = {k: v for k, v in status.items() if v is not None}
        rollout.metadata = {**rollout.metadata, "agl": {**agl, "status": status}}
        values = checked(schema.rollouts, {"metadata": rollout.metadata, "status": rollout.status.value})
        c.execute(sa.update(schema.rollouts).where(R.id == row.id).values(values))
    return AglRow.of(rollout)


def _step(store, c, rollout: Rollout, target: str, worker_id: str, error: str | None) -> int | None:
    """Move the rollout's attempts for `target`; the rollout's terminal position when it ends."""
    current = AGL_STATE[rollout.status]
    if target not in AGL_MOVES.get(current, ()):
        raise IllegalMove(f"rollout {rollout.rollout_id}: cannot transition {current} -> {target}")
    if target == "running":
        store._begin_attempt(c, rollout.rollout_id, worker_id)
        return None
    latest = store._latest_attempt(c, rollout.rollout_id)
    ended = AttemptState.succeeded if target == "succeeded" else AttemptState.failed
    if latest is not None and latest.state in (AttemptState.running.value, AttemptState.queued.value):
        live = AttemptState(latest.state)
        final = ended if live is AttemptState.running else AttemptState.cancelled
        check_transition(latest.attempt_id, live, final)
        reason = {"reason_code": "agl_" + target, "reason_message": error}
        store._move(c, latest, final, {k: v for k, v in reason.items() if v is not None})
    return _bump_counter(c)


def named_attempt(store, rollout_id: str, name: str, worker_id: str) -> Attempt:
    """The attempt named `name`; a queuing rollout's next one starts now (agents post to "0" at once)."""
    index, rollout = attempt_index(name), get(store, rollout_id)
    if index is None:
        raise NotFound(
            f"attempt {name!r} of rollout {rollout_id!r}: attempts are named by their sequence, '0' first"
        )
    attempts = sorted(store.list_attempts(rollout_id=rollout_id), key=lambda a: a.sequence_id)
    waiting = len(attempts) - (1 if attempts and attempts[-1].state == AttemptState.queued else 0)
    if index == waiting and rollout.status == RolloutStatus.queued.value:
        try:
            move(store, rollout_id, {"state": "running"}, worker_id)
        except IllegalMove:
            pass  # another request started it first
        attempts = sorted(store.list_attempts(rollout_id=rollout_id), key=lambda a: a.sequence_id)
    if index >= len(attempts):
        raise NotFound(f"rollout {rollout_id!r} has no attempt {name!r} (it has {len(attempts)})")
    return attempts[index]


def delete(store, rollout_id: str) -> list[str]:
    """Hide the rollout from this API (kept as lineage); its attempt ids (none if hidden already)."""
    with store._write() as c:
        hidden = c.execute(
            sa.update(schema.rollouts)
            .where(R.rollout_id == rollout_id, R.harness == HARNESS)
            .values(harness=DELETED)
        ).rowcount
        return _attempt_ids(c, rollout_id) if hidden else []


def new_rollout(rollout_id: str, item: dict[str, Any], sampling: dict[str, Any]) -> Rollout:
    """Our rollout for one Agent Lightning `RolloutCreate` (already validated)."""
    inp = item.get("input")
    data_id = (inp.get("data_id") or inp.get("instance_id") or "") if isinstance(inp, dict) else ""
    t = now()
    is_train = item.get("is_train", True)
    return Rollout(
        rollout_id=rollout_id,
        kind=RolloutKind.train if is_train else RolloutKind.holdout,
        task_id=str(data_id),
        task={"input": inp},
        harness=HARNESS,
        created_at=t,
        metadata={
            "sampling": sampling,
            "agl": {
                "is_train": is_train,
                "config": item.get("config") or {},
                "metadata": item.get("metadata") or {},
                "status": {"version": 1, "updated_at": t},
            },
        },
    )
