"""The rollout queue and the attempt state machine: resources, rollouts, claims, retries, transitions,
heartbeats, and the `serve` rollouts of client sessions."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa

from lightning_dagster.store import schema
from lightning_dagster.store.connection import (
    Connection,
    as_record,
    checked,
    enum_values,
    from_row,
    nonempty_text,
    to_row,
)
from lightning_dagster.store.errors import Conflict, InvalidInput, NotFound
from lightning_dagster.types import (
    TERMINAL_ATTEMPT_STATES,
    Attempt,
    AttemptState,
    Resource,
    RetryKind,
    Rollout,
    RolloutKind,
    RolloutStatus,
    check_transition,
    now,
)

R, A = schema.rollouts.c, schema.attempts.c

# A rollout's status follows its latest attempt; whether a failure is final is the runner's call.
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


def _running_attempt(rollout_id: str, worker_id: str, **fields: Any) -> Attempt:
    t = now()
    return Attempt(
        rollout_id=rollout_id,
        state=AttemptState.running,
        worker_id=worker_id,
        started_at=t,
        heartbeat_at=t,
        **fields,
    )


class RolloutQueue(Connection):
    def add_resource(self, r: Resource) -> Resource:
        r = as_record(Resource, r)
        with self._write() as c:
            c.execute(schema.resources.insert(), checked(schema.resources, to_row(r)))
        return r

    def get_resource(self, resource_id: str) -> Resource:
        return self._one(Resource, schema.resources, schema.resources.c.resource_id, resource_id)

    def list_resources(self) -> list[Resource]:
        return self._all(Resource, sa.select(schema.resources).order_by(schema.resources.c.id))

    def enqueue_rollouts(self, rollouts: list[Rollout]) -> list[Rollout]:
        items = [as_record(Rollout, r).model_copy(update={"status": RolloutStatus.queued}) for r in rollouts]
        if items:
            with self._write() as c:
                c.execute(schema.rollouts.insert(), [checked(schema.rollouts, to_row(r)) for r in items])
        return items

    def get_rollout(self, rollout_id: str) -> Rollout:
        return self._one(Rollout, schema.rollouts, R.rollout_id, rollout_id)

    def _rollout_filters(
        self,
        snapshot_key=None,
        kind=None,
        status=None,
        created_after=None,
        rollout_ids=None,
        group_ids=None,
        harness=None,
    ) -> list[sa.ColumnElement[bool]]:
        where = []
        if group_ids is not None:
            where.append(R.group_id.in_(list(group_ids)))
        if harness is not None:
            where.append(R.harness == harness)
        if snapshot_key is not None:
            where.append(R.snapshot_key == snapshot_key)
        if kind is not None:
            where.append(R.kind.in_(enum_values(RolloutKind, kind)))
        if status is not None:
            where.append(R.status.in_(enum_values(RolloutStatus, status)))
        if created_after is not None:
            where.append(R.created_at > float(created_after))
        if rollout_ids is not None:
            where.append(self._ids_in(R.rollout_id, rollout_ids))
        return where

    def query_rollouts(
        self,
        *,
        snapshot_key: str | None = None,
        kind: RolloutKind | str | Iterable[RolloutKind | str] | None = None,
        status: RolloutStatus | str | Iterable[RolloutStatus | str] | None = None,
        created_after: float | None = None,
        rollout_ids: Iterable[str] | None = None,
        group_ids: Iterable[str] | None = None,
        harness: str | None = None,
        limit: int | None = None,
    ) -> list[Rollout]:
        """Oldest first. `kind` and `status` take one value or several; `group_ids`, `harness`: additions."""
        where = self._rollout_filters(
            snapshot_key, kind, status, created_after, rollout_ids, group_ids, harness
        )
        query = sa.select(schema.rollouts).where(*where).order_by(R.id)
        return self._all(Rollout, query if limit is None else query.limit(int(limit)))

    def count_rollouts(
        self,
        *,
        status: RolloutStatus | str | Iterable[RolloutStatus | str] | None = None,
        rollout_ids: Iterable[str] | None = None,
        harness: str | None = None,
    ) -> int:
        """How many rollouts match, counted in the database (an addition to the contract)."""
        where = self._rollout_filters(None, None, status, None, rollout_ids, None, harness)
        with self.engine.connect() as c:
            return c.execute(
                sa.select(sa.func.count()).select_from(schema.rollouts).where(*where)
            ).scalar_one()

    def claim_rollout(
        self,
        worker_id: str,
        *,
        kinds: RolloutKind | str | Iterable[RolloutKind | str] | None = None,
        snapshot_key: str | None = None,
        rollout_ids: Iterable[str] | None = None,
        harness: str | None = None,
        policy_versions: Iterable[int] | None = None,
    ) -> tuple[Rollout, Attempt] | None:
        """The oldest queued rollout past its backoff, its attempt now running; `policy_versions`: untagged
        rollouts, or those whose `metadata.policy_version` is among these."""
        where = self._rollout_filters(
            snapshot_key, kinds, RolloutStatus.queued, None, rollout_ids, None, harness
        )
        where.append(sa.or_(R.not_before.is_(None), R.not_before <= now()))
        if policy_versions is not None:
            tag = schema.rollouts.c["metadata"]["policy_version"].as_integer()
            where.append(sa.or_(tag.is_(None), tag.in_([int(v) for v in policy_versions])))
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
            attempt = self._begin_attempt(c, row.rollout_id, worker_id)
        return from_row(Rollout, row).model_copy(update={"status": RolloutStatus.running}), attempt

    def _begin_attempt(self, c, rollout_id: str, worker_id: str) -> Attempt:
        """In `c`: the rollout's queued attempt, or a new one (an infrastructure retry after any), runs."""
        latest = self._latest_attempt(c, rollout_id)
        if latest is not None and latest.state == AttemptState.queued.value:
            return self._move(c, latest, AttemptState.running, {"worker_id": worker_id})
        attempt = _running_attempt(
            rollout_id,
            worker_id,
            sequence_id=latest.sequence_id + 1 if latest else 1,
            retry_kind=RetryKind.infrastructure if latest else RetryKind.first,
        )
        self._add_attempt(c, attempt)
        return attempt

    def retry_rollout(self, rollout_id: str, retry_kind: RetryKind, *, delay_s: float = 0.0) -> Attempt:
        """A new queued attempt after a finished one, claimable `delay_s` from now (an addition)."""
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
            not_before = now() + delay_s if delay_s > 0 else None
            c.execute(
                sa.update(schema.rollouts).where(R.rollout_id == rollout_id).values(not_before=not_before)
            )
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
        self._update_one(schema.rollouts, R.rollout_id, rollout_id, {"status": status.value})

    def heartbeat(self, attempt_id: str) -> None:
        self._update_one(schema.attempts, A.attempt_id, attempt_id, {"heartbeat_at": now()})

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
            query = query.where(self._ids_in(A.rollout_id, rollout_ids))
        if state is not None:
            query = query.where(A.state.in_(enum_values(AttemptState, state)))
        return self._all(Attempt, query)

    def stale_attempts(
        self, cutoff: float, *, harness: str | None = None, rollout_ids: Iterable[str] | None = None
    ) -> list[Attempt]:
        """Running attempts whose last heartbeat (or start) is older than `cutoff` (an addition)."""
        last = sa.func.coalesce(A.heartbeat_at, A.started_at, 0.0)
        query = sa.select(schema.attempts).where(A.state == AttemptState.running.value, last < cutoff)
        if harness is not None or rollout_ids is not None:
            rollouts = sa.select(R.rollout_id).where(
                *self._rollout_filters(rollout_ids=rollout_ids, harness=harness)
            )
            query = query.where(A.rollout_id.in_(rollouts))
        return self._all(Attempt, query.order_by(A.id))

    def get_or_create_serve_rollout(
        self, session: str, resource_id: str | None, *, owner: str | None = None
    ) -> tuple[Rollout, Attempt]:
        """One `serve` rollout per client session, with a running attempt; concurrent first calls agree."""
        session = nonempty_text("session", session)
        found = self._serve_rollout(session)
        if found is not None:
            return found
        rollout = Rollout(
            kind=RolloutKind.serve,
            resource_id=resource_id,
            status=RolloutStatus.running,
            metadata={"session": session, "owner": owner},
        )
        attempt = _running_attempt(rollout.rollout_id, "serve")
        row = checked(schema.rollouts, {**to_row(rollout), "session": session})
        try:
            with self._write() as c:
                c.execute(schema.rollouts.insert(), row)
                c.execute(schema.attempts.insert(), to_row(attempt))
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
            return from_row(Rollout, row), from_row(Attempt, self._latest_attempt(c, row.rollout_id))

    # Locks are taken rollout first, then attempt: no two transactions wait on each other in opposite
    # orders (PostgreSQL would abort one as a deadlock).

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
        c.execute(schema.attempts.insert(), checked(schema.attempts, to_row(attempt)))
        self._follow(c, attempt.rollout_id, attempt.sequence_id, attempt.state)

    def _move(self, c: sa.Connection, row: sa.Row, target: AttemptState, values: dict[str, Any]) -> Attempt:
        check_transition(row.attempt_id, AttemptState(row.state), target)
        t = now()
        values = checked(schema.attempts, {**values, "state": target.value})
        if target is AttemptState.running:
            values.update(started_at=t, heartbeat_at=t)
        if target in TERMINAL_ATTEMPT_STATES:
            values["ended_at"] = t
        c.execute(sa.update(schema.attempts).where(A.id == row.id).values(values))
        self._follow(c, row.rollout_id, row.sequence_id, target)
        return Attempt.model_validate({**{k: row._mapping[k] for k in Attempt.model_fields}, **values})
