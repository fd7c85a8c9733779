"""alembic revisions of the store schema."""
