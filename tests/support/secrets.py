"""A gateway secret written the way the CLIs accept it: a file only this user can read."""

from __future__ import annotations

import os
from pathlib import Path


def secret_file(directory: Path, secret: str, name: str = "gateway.secret") -> str:
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    return str(path)
