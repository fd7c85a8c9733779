"""alembic environment: runs on the connection `lightning_dagster.store.migrate.upgrade` passes in."""

from alembic import context

from lightning_dagster.store.schema import metadata

context.configure(connection=context.config.attributes["connection"], target_metadata=metadata)
with context.begin_transaction():
    context.run_migrations()
