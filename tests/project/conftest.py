"""Every project test undoes the imports and sys.path entries its projects add."""

from tests.support.project_imports import restore_import_state  # noqa: F401 (an autouse fixture)
