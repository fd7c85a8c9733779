"""The store side of the Agent Lightning v1.0 server surface: rollouts created through its REST API (marked
`harness="agl"`), their lifecycle moves in one transaction each, and the completion log its terminal page
reads. Functions over a `Store`, so the facade keeps its four parts.

An Agent Lightning rollout is one of ours: `task = {"input": <its input>}`, kind `train` when `is_train`,
else `holdout`, and `metadata["agl"]` keeps its `config`, `metadata`, `is_train` and the status fields our
rollout has no column for (`k8s_job_name`, `last_attempt_id`, `error_message`, `version`, `updated_at`,
`terminal_seq`). Its state is our status: `queuing` is `queued`, `cancelled` reads as `failed`.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from lightning_dagster.store import schema
from lightning_dagster.store.connection import checked, from_row, to_row
from lightning_dagster.store.errors import Conflict, NotFound
from lightning_dagster.types import (
    Attempt,
    AttemptState,
    RetryKind,
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

AGL_STATE = {
    RolloutStatus.queued: "queuing",
    RolloutStatus.running: "running",
    RolloutStatus.succeeded: "succeeded",
    RolloutStatus.failed: "failed",
    RolloutStatus.cancelled: "failed",
}
OUR_STATUS = {"queuing": [RolloutStatus.queued], "running": [RolloutStatus.running],
              "succeeded": [RolloutStatus.succeeded],
              "failed": [RolloutStatus.failed, RolloutStatus.cancelled]}  # fmt: skip
# Agent Lightning's lifecycle: terminal states have no way out, and a rollout never goes back to queuing.
AGL_MOVES = {"queuing": {"running", "failed"}, "running": {"succeeded", "failed"}}


class IllegalMove(Conflict):
    """A lifecycle move Agent Lightning's state machine does not have (409)."""


def create(store, rollouts: list[Rollout]) -> list[Rollout]:
    """Insert the rollouts whose id is new; an existing id (ours, not deleted) returns the stored rollout
    unchanged, so a client retrying a batch with its own ids creates each once."""
    ids = [r.rollout_id for r in rollouts]
    with store._write() as c:
        rows = c.execute(sa.select(schema.rollouts).where(R.rollout_id.in_(ids))).all()
        found = {row.rollout_id: row for row in rows}
        out, fresh = [], []
        for r in rollouts:
            row = found.get(r.rollout_id)
            if row is not None and row.harness != HARNESS:
                raise Conflict(f"rollout_id: {r.rollout_id!r} is taken by a rollout not of this API")
            if row is None:
                found[r.rollout_id] = r  # a repeated id within one batch is created once
                fresh.append(checked(schema.rollouts, to_row(r)))
                out.append(r)
            else:
                out.append(row if isinstance(row, Rollout) else from_row(Rollout, row))
        if fresh:
            c.execute(schema.rollouts.insert(), fresh)
    return out


def get(store, rollout_id: str) -> Rollout:
    rollout = store.get_rollout(rollout_id)
    if rollout.harness != HARNESS:
        raise NotFound(f"rollout {rollout_id!r} not found")
    return rollout


def query(store, states: list[str], limit: int) -> list[Rollout]:
    """Rollouts of this API in the given Agent Lightning states, oldest first (the status index)."""
    statuses = [s.value for state in states for s in OUR_STATUS[state]]
    q = sa.select(schema.rollouts).where(R.status.in_(statuses), R.harness == HARNESS).order_by(R.id)
    return store._all(Rollout, q.limit(limit))


def terminal_page(store, after: int, limit: int) -> tuple[list[Rollout], int, int]:
    """Terminal rollouts in completion order after position `after`: (rollouts, next_after, total). A
    deleted rollout keeps its position (skipped in the page), so a cursor never misses one."""
    seq = R.metadata[("agl", "status", "terminal_seq")].as_integer()
    with store.engine.connect() as c:
        total = _counter(c)
        stop = min(after + limit, total)
        q = sa.select(schema.rollouts).where(R.harness == HARNESS, seq > after, seq <= stop).order_by(seq)
        rows = [from_row(Rollout, row) for row in c.execute(q)]
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


def move(store, rollout_id: str, fields: dict[str, Any], worker_id: str) -> Rollout:
    """Apply one status patch in one transaction: `state` moves the rollout along Agent Lightning's
    lifecycle through our attempt state machine (running: a new running attempt; succeeded/failed: its
    current attempt ends so; queuing -> failed: no attempt ran); the other fields are kept in
    `metadata["agl"]["status"]`. Raises IllegalMove (nothing changed) for a move the lifecycle lacks."""
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
    return rollout


def _step(store, c, rollout: Rollout, target: str, worker_id: str, error: str | None) -> int | None:
    """Move the rollout's attempts for `target`; the rollout's terminal position when it ends."""
    current = AGL_STATE[rollout.status]
    if target not in AGL_MOVES.get(current, ()):
        raise IllegalMove(f"rollout {rollout.rollout_id}: cannot transition {current} -> {target}")
    latest = store._latest_attempt(c, rollout.rollout_id)
    if target == "running":
        if latest is not None and latest.state == AttemptState.queued.value:
            store._move(c, latest, AttemptState.running, {"worker_id": worker_id})
        else:
            t = now()
            attempt = Attempt(
                rollout_id=rollout.rollout_id,
                sequence_id=latest.sequence_id + 1 if latest else 1,
                state=AttemptState.running,
                retry_kind=RetryKind.infrastructure if latest else RetryKind.first,
                worker_id=worker_id,
                started_at=t,
                heartbeat_at=t,
            )
            store._add_attempt(c, attempt)
        return None
    ended = AttemptState.succeeded if target == "succeeded" else AttemptState.failed
    if latest is not None and latest.state in (AttemptState.running.value, AttemptState.queued.value):
        live = AttemptState(latest.state)
        final = ended if live is AttemptState.running else AttemptState.cancelled
        check_transition(latest.attempt_id, live, final)
        reason = {"reason_code": "agl_" + target, "reason_message": error}
        store._move(c, latest, final, {k: v for k, v in reason.items() if v is not None})
    return _bump_counter(c)


def current_attempt(store, rollout_id: str, worker_id: str) -> Attempt:
    """The rollout's latest attempt; a rollout still queuing gets its first attempt started now (an agent
    calling before its controller's `running` patch arrives)."""
    rollout = get(store, rollout_id)
    attempts = store.list_attempts(rollout_id=rollout_id)
    if attempts and attempts[-1].state != AttemptState.queued:
        return attempts[-1]
    if rollout.status is RolloutStatus.queued:
        try:
            move(store, rollout_id, {"state": "running"}, worker_id)
        except IllegalMove:
            pass  # another request started it first
        attempts = store.list_attempts(rollout_id=rollout_id)
    if not attempts:
        raise Conflict(f"rollout {rollout_id!r} has no attempt")
    return attempts[-1]


def delete(store, rollout_id: str) -> None:
    """Hide the rollout from this API (idempotent; a missing id is fine). Its attempts, spans and rewards
    stay in the store: they are lineage of whatever was trained on them."""
    with store._write() as c:
        c.execute(
            sa.update(schema.rollouts)
            .where(R.rollout_id == rollout_id, R.harness == HARNESS)
            .values(harness=DELETED)
        )


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
