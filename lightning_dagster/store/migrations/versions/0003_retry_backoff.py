"""Queued retries wait out their backoff (`rollouts.not_before`); a run's rollouts are found by group id.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # 0001 creates today's tables when none exist, so the column may already be there: add what is missing.
    inspector = sa.inspect(op.get_bind())
    present = {c["name"] for c in inspector.get_columns("rollouts")}
    with op.batch_alter_table("rollouts") as batch:
        if "not_before" not in present:
            batch.add_column(sa.Column("not_before", sa.Double))
    if "ix_rollouts_group_id" not in {i["name"] for i in inspector.get_indexes("rollouts")}:
        op.create_index("ix_rollouts_group_id", "rollouts", ["group_id"])


def downgrade() -> None:
    raise NotImplementedError("the store's history is append-only; restore from a backup instead")
