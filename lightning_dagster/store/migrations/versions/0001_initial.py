"""Initial schema.

Revision ID: 0001
Revises:
"""

from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The baseline: fresh databases never run this (migrate.upgrade creates them from schema.metadata and
    # stamps head). It creates today's tables, so every later revision adds only what is missing.
    from lightning_dagster.store.schema import metadata

    metadata.create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    raise NotImplementedError("the store's history is append-only; restore from a backup instead")
