"""The store under bad input and hostile conditions: both stores refuse alike what PostgreSQL cannot hold,
a reward commits with its span and once per request id, and a locked or read-only store says so in one
line."""

from __future__ import annotations

import sqlite3
import time

import pytest
import sqlalchemy as sa

from lightning_dagster.store import Conflict, InvalidInput, Store, migrate
from lightning_dagster.store.errors import StoreLocked, StoreReadOnly
from lightning_dagster.types import Reward, Rollout, Span, SpanKind


def _attempt(store):
    (r,) = store.enqueue_rollouts([Rollout()])
    _, a = store.claim_rollout("w", rollout_ids=[r.rollout_id])
    return r.rollout_id, a.attempt_id


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("name", "n" * 257, "spans.name: 257 characters; the limit is 256"),
        ("name", "a\x00b", "spans.name: contains a NUL character"),
        ("attributes", {"note": float("nan")}, "spans.attributes.note: nan is not a finite number"),
        ("attributes", {"x": [1, float("-inf")]}, "spans.attributes.x.1: -inf is not a finite number"),
        ("attributes", {"x": {"y": "\x00"}}, "spans.attributes.x.y: contains a NUL character"),
        ("sequence", 2**31, "spans.sequence: 2147483648 is outside the 32-bit integer range"),
        ("end_time", float("nan"), "spans.end_time: nan is not a finite number"),
    ],
)
def test_both_stores_refuse_what_postgresql_cannot_hold_naming_the_column(store, field, value, message):
    rid, aid = _attempt(store)
    span = Span(rollout_id=rid, attempt_id=aid, kind=SpanKind.custom, **{field: value})
    with pytest.raises(InvalidInput) as refused:
        store.add_spans([span])
    assert str(refused.value) == message
    assert store.list_spans(attempt_id=aid) == []
    store.add_spans([Span(rollout_id=rid, attempt_id=aid, attributes={"text": "NaN is fine as text"})])
    assert store.list_spans(attempt_id=aid)[0].attributes == {"text": "NaN is fine as text"}


def test_other_tables_are_checked_too(store):
    rid, aid = _attempt(store)
    with pytest.raises(InvalidInput, match="rewards.judge: 129 characters"):
        store.add_reward(Reward(rollout_id=rid, attempt_id=aid, value=1.0, judge="j" * 129))
    with pytest.raises(InvalidInput, match="documents.body.x: nan"):
        store.append_document("c", "d", "h", {"x": float("nan")}, None)
    with pytest.raises(InvalidInput, match="flags.key: contains a NUL"):
        store.set_flag("k\x00", {})
    with pytest.raises(InvalidInput, match="rollouts.session: 257 characters"):
        store.get_or_create_serve_rollout("s" * 257, None)
    # A record's non-finite number is refused, not stored as null (pydantic's JSON-mode dump would do that)
    with pytest.raises(InvalidInput, match=r"rollouts.task.a.0: inf is not a finite number"):
        store.enqueue_rollouts([Rollout(task={"a": [float("inf")]})])
    with pytest.raises(InvalidInput, match=r"rollouts.metadata.m: nan is not a finite number"):
        store.enqueue_rollouts([Rollout(metadata={"m": float("nan")})])
    with pytest.raises(InvalidInput, match=r"rewards.value: -inf is not a finite number"):
        store.add_reward(Reward(rollout_id=rid, attempt_id=aid, value=float("-inf")))
    assert store.list_rewards() == [] and store.document_versions("c", "d") == []
    assert [r.rollout_id for r in store.query_rollouts()] == [rid]


def test_a_reward_and_its_span_commit_together_once_per_request_id(store, monkeypatch):
    rid, aid = _attempt(store)
    reward = Reward(rollout_id=rid, attempt_id=aid, value=0.5)
    span = Span(rollout_id=rid, attempt_id=aid, kind=SpanKind.reward, name="reward")

    def fail(c, rows):
        raise RuntimeError("injected after the reward row")

    with monkeypatch.context() as patch:
        patch.setattr(store, "_insert_spans", fail)
        with pytest.raises(RuntimeError, match="injected"):
            store.add_reward(reward, span=span, request_id="req-1")
    assert store.list_rewards() == [] and store.list_spans(attempt_id=aid) == []
    assert store.add_reward(reward, span=span, request_id="req-1") == span.span_id
    retry_span = Span(rollout_id=rid, attempt_id=aid, kind=SpanKind.reward, name="reward")
    assert store.add_reward(reward, span=retry_span, request_id="req-1") == span.span_id
    assert len(store.list_rewards()) == 1 and [s.span_id for s in store.list_spans(attempt_id=aid)] == [
        span.span_id
    ]
    with pytest.raises(Conflict, match="req-1"):
        store.add_reward(reward.model_copy(update={"value": 0.9}), request_id="req-1")
    store.add_reward(reward)  # no request id: every call is a new reward
    store.add_reward(reward)
    assert len(store.list_rewards()) == 3


def test_a_locked_sqlite_store_names_its_path_and_cause_after_the_bounded_wait(tmp_path):
    path = tmp_path / "store.db"
    Store(f"sqlite:///{path}").close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store = Store(f"sqlite:///{path}", busy_timeout_s=0.3)
        started = time.monotonic()
        with pytest.raises(StoreLocked) as locked:
            store.set_flag("k", {"v": 1})
        assert time.monotonic() - started < 5
        message = str(locked.value)
        assert "\n" not in message and str(path) in message and "locked by another process" in message
        assert "0.3s" in message
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    store.set_flag("k", {"v": 1})  # the lock released, the same store writes
    store.close()


def test_a_read_only_store_reads_and_refuses_writes_saying_why(tmp_path):
    path = tmp_path / "store.db"
    with Store(f"sqlite:///{path}") as store:
        store.set_flag("k", {"v": 1})
        rid, _ = _attempt(store)
    with Store(f"sqlite:///file:{path}?mode=ro&uri=true") as ro:
        assert ro.get_flag("k") == {"v": 1} and [r.rollout_id for r in ro.query_rollouts()] == [rid]
        for write in (lambda: ro.set_flag("k", {"v": 2}), lambda: ro.enqueue_rollouts([Rollout()])):
            with pytest.raises(StoreReadOnly) as refused:
                write()
            assert str(path) in str(refused.value) and "read-only" in str(refused.value)
            assert "\n" not in str(refused.value)
    assert not (tmp_path / "file:").exists()


def test_a_version_1_rewards_table_is_upgraded_keeping_its_rows(store_url):
    engine = sa.create_engine(store_url)
    old = sa.MetaData()
    sa.Table(
        "rewards",
        old,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("rollout_id", sa.String(64), nullable=False),
        sa.Column("attempt_id", sa.String(64)),
        sa.Column("value", sa.Double, nullable=False),
        sa.Column("judge", sa.String(128), nullable=False),
        sa.Column("judge_version", sa.String(64), nullable=False),
        sa.Column("uncertainty", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    from lightning_dagster.store.schema import metadata

    with engine.begin() as c:
        metadata.create_all(c, tables=[t for t in metadata.sorted_tables if t.name != "rewards"])
        old.create_all(c)
        c.execute(sa.text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)"))
        c.execute(sa.text("INSERT INTO alembic_version VALUES ('0001')"))
        c.execute(sa.text("INSERT INTO rollouts (rollout_id, kind, task_id, task, status, created_at, metadata) "
                          "VALUES ('ro-1', 'train', 't', '{}', 'queued', 0, '{}')"))  # fmt: skip
        c.execute(sa.text("INSERT INTO rewards (rollout_id, value, judge, judge_version, created_at) "
                          "VALUES ('ro-1', 0.5, 'h', '1', 0)"))  # fmt: skip
    engine.dispose()
    with Store(store_url) as store:
        with store.engine.connect() as c:
            assert migrate.current_revision(c) == migrate.HEAD
        assert [r.value for r in store.list_rewards()] == [0.5]
        reward = Reward(rollout_id="ro-1", value=1.0)
        store.add_reward(reward, request_id="r")
        store.add_reward(reward, request_id="r")
        assert [r.value for r in store.list_rewards()] == [0.5, 1.0]
