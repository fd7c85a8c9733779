"""Code versions for the lineage view: a hash of the source of the core packages an asset calls, read from
the files on disk without importing them, so loading the definitions stays cheap.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@cache
def code_version(*packages: str) -> str:
    digest = hashlib.sha256()
    for package in sorted(packages):
        for path in sorted((PACKAGE_ROOT / package).rglob("*.py")):  # none for a name that is no folder
            digest.update(str(path.relative_to(PACKAGE_ROOT)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:12]
