"""Loading a project puts its folder on sys.path and imports its modules: undo that after each test so
the temporary projects leave nothing behind for other tests."""

from __future__ import annotations

import sys
import tempfile

import pytest


@pytest.fixture(autouse=True)
def restore_import_state():
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(tempfile.gettempdir()):
            del sys.modules[name]
