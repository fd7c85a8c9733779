"""Loading a project puts its folder on sys.path and imports its modules: `restore_import_state` undoes
that after each test that imports it (as an autouse fixture) so temporary projects leave nothing behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def restore_import_state():
    path, modules = list(sys.path), set(sys.modules)
    yield
    # Only modules imported from the folders a project put on sys.path: a library imported for the first
    # time during the test (pandas' parquet support, say) must stay, or importing it again breaks it.
    added = [str(Path(entry).resolve()) + os.sep for entry in set(sys.path) - set(path)]
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if any(file.startswith(root) for root in added):
            del sys.modules[name]
