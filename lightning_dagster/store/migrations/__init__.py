"""alembic scripts of the store (a package so that non-editable installs ship them)."""
