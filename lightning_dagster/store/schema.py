"""The store's tables, columns named as `lightning_dagster.types` fields; a `_table`'s `id` fixes insertion
order. Triggers refuse UPDATE and DELETE of documents and pointer moves, even by raw SQL."""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()


def _key(name: str, **kw) -> sa.Column:
    return sa.Column(name, sa.String(64), nullable=False, unique=True, **kw)


def _table(name: str, *items: sa.SchemaItem) -> sa.Table:
    return sa.Table(name, metadata, sa.Column("id", sa.Integer, primary_key=True, autoincrement=True), *items)


resources = _table(
    "resources",
    _key("resource_id"),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("uri", sa.Text, nullable=False),
    sa.Column("parent_id", sa.String(64)),
    sa.Column("weights_hash", sa.String(128)),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("metadata", sa.JSON, nullable=False),
)

rollouts = _table(
    "rollouts",
    _key("rollout_id"),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("task_id", sa.String(256), nullable=False),
    sa.Column("task", sa.JSON, nullable=False),
    sa.Column("snapshot_key", sa.String(128), index=True),
    sa.Column("group_id", sa.String(128)),
    sa.Column("resource_id", sa.String(64)),
    sa.Column("harness", sa.String(128)),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.Column("metadata", sa.JSON, nullable=False),
    # serve rollouts only: one rollout per client session, unique so concurrent first calls agree
    sa.Column("session", sa.String(256), unique=True),
    # a queued infrastructure retry is not claimed before this time (the retry policy's backoff)
    sa.Column("not_before", sa.Double),
    sa.Index("ix_rollouts_status_id", "status", "id"),
    sa.Index("ix_rollouts_group_id", "group_id"),
)

attempts = _table(
    "attempts",
    _key("attempt_id"),
    sa.Column("rollout_id", sa.String(64), sa.ForeignKey("rollouts.rollout_id"), nullable=False),
    sa.Column("sequence_id", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("retry_kind", sa.String(16), nullable=False),
    sa.Column("reason_code", sa.String(64)),
    sa.Column("reason_message", sa.Text),
    sa.Column("worker_id", sa.String(128)),
    sa.Column("heartbeat_at", sa.Double),
    sa.Column("started_at", sa.Double),
    sa.Column("ended_at", sa.Double),
    sa.UniqueConstraint("rollout_id", "sequence_id", name="uq_attempts_rollout_seq"),
)

spans = _table(
    "spans",
    _key("span_id"),
    sa.Column("trace_id", sa.String(64), nullable=False),
    sa.Column("parent_span_id", sa.String(64)),
    sa.Column("rollout_id", sa.String(64), sa.ForeignKey("rollouts.rollout_id"), nullable=False, index=True),
    sa.Column("attempt_id", sa.String(64), sa.ForeignKey("attempts.attempt_id"), nullable=False),
    sa.Column("sequence", sa.Integer, nullable=False),
    sa.Column("name", sa.String(256), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("start_time", sa.Double, nullable=False),
    sa.Column("end_time", sa.Double),
    sa.Column("status", sa.String(8), nullable=False),
    sa.Column("attributes", sa.JSON, nullable=False),
    sa.Column("finish_reason", sa.String(32)),
    sa.Column("resource_id", sa.String(64)),
    # Token fields (see tokens.py): prompt = context(prompt_ref)[:prompt_shared] + prompt_tail, where
    # context(s) = prompt(s) + response(s). NULL prompt_tail means the span has no prompt ids at all.
    sa.Column("prompt_ref", sa.String(64)),
    sa.Column("prompt_shared", sa.Integer),
    sa.Column("prompt_tail", sa.LargeBinary),
    sa.Column("response_ids", sa.LargeBinary),
    sa.Column("response_logprobs", sa.LargeBinary),
    sa.Index("ix_spans_attempt_seq", "attempt_id", "sequence"),
)

rewards = _table(
    "rewards",
    sa.Column("rollout_id", sa.String(64), sa.ForeignKey("rollouts.rollout_id"), nullable=False, index=True),
    sa.Column("attempt_id", sa.String(64), sa.ForeignKey("attempts.attempt_id")),
    sa.Column("value", sa.Double, nullable=False),
    sa.Column("judge", sa.String(128), nullable=False),
    sa.Column("judge_version", sa.String(64), nullable=False),
    sa.Column("uncertainty", sa.Double),
    sa.Column("created_at", sa.Double, nullable=False),
    # the client's request id (Idempotency-Key): a retried request stores its reward once
    sa.Column("request_id", sa.String(256)),
    sa.Column("span_id", sa.String(64)),  # the span recording this reward, committed with it
    sa.UniqueConstraint("rollout_id", "request_id", name="uq_rewards_request"),
)

documents = _table(
    "documents",
    sa.Column("collection", sa.String(128), nullable=False),
    sa.Column("doc_id", sa.String(256), nullable=False),
    sa.Column("version", sa.Integer, nullable=False),
    sa.Column("content_hash", sa.String(128), nullable=False),
    sa.Column("previous_hash", sa.String(128)),
    sa.Column("body", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Double, nullable=False),
    sa.UniqueConstraint("collection", "doc_id", "version", name="uq_documents_version"),
)

pointers = sa.Table(
    "pointers",
    metadata,
    sa.Column("name", sa.String(256), primary_key=True),
    sa.Column("value", sa.String(256), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

pointer_moves = _table(
    "pointer_moves",
    sa.Column("name", sa.String(256), nullable=False),
    sa.Column("seq", sa.Integer, nullable=False),
    sa.Column("from_value", sa.String(256)),
    sa.Column("to_value", sa.String(256), nullable=False),
    sa.Column("actor", sa.String(256), nullable=False),
    sa.Column("receipt_id", sa.String(256)),
    sa.Column("note", sa.Text, nullable=False),
    sa.Column("moved_at", sa.Double, nullable=False),
    sa.UniqueConstraint("name", "seq", name="uq_pointer_moves_seq"),
)

flags = sa.Table(
    "flags",
    metadata,
    sa.Column("key", sa.String(256), primary_key=True),
    sa.Column("value", sa.JSON, nullable=False),
    sa.Column("updated_at", sa.Double, nullable=False),
)

_PG_APPEND_ONLY_FN = sa.DDL(
    "CREATE OR REPLACE FUNCTION ld_append_only() RETURNS trigger LANGUAGE plpgsql AS "
    "$$ BEGIN RAISE EXCEPTION USING MESSAGE = TG_TABLE_NAME || ' is append-only'; END $$"
)


def _append_only(table: sa.Table) -> None:
    """Attach the refuse-UPDATE/DELETE triggers to `table`, created together with it."""
    name = table.name
    sqlite = [
        f"CREATE TRIGGER {name}_no_{op.lower()} BEFORE {op} ON {name} "
        f"BEGIN SELECT RAISE(ABORT, '{name} is append-only'); END"
        for op in ("UPDATE", "DELETE")
    ]
    postgresql = f"CREATE TRIGGER {name}_append_only BEFORE UPDATE OR DELETE ON {name} "
    postgresql += "FOR EACH ROW EXECUTE FUNCTION ld_append_only()"
    for ddl in [
        *(sa.DDL(sql).execute_if(dialect="sqlite") for sql in sqlite),
        _PG_APPEND_ONLY_FN.execute_if(dialect="postgresql"),
        sa.DDL(postgresql).execute_if(dialect="postgresql"),
    ]:
        sa.event.listen(table, "after_create", ddl)


_append_only(documents)
_append_only(pointer_moves)
