"""Rewards remember the request that stored them (a retry stores nothing new) and the span recording them.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # 0001 creates today's tables when none exist, so the columns may already be there: add what is missing.
    inspector = sa.inspect(op.get_bind())
    present = {c["name"] for c in inspector.get_columns("rewards")}
    with op.batch_alter_table("rewards") as batch:
        if "request_id" not in present:
            batch.add_column(sa.Column("request_id", sa.String(256)))
        if "span_id" not in present:
            batch.add_column(sa.Column("span_id", sa.String(64)))
        if "uq_rewards_request" not in {u["name"] for u in inspector.get_unique_constraints("rewards")}:
            batch.create_unique_constraint("uq_rewards_request", ["rollout_id", "request_id"])


def downgrade() -> None:
    raise NotImplementedError("the store's history is append-only; restore from a backup instead")
