"""The training transitions of one snapshot as a gzipped JSON-lines file (rows, then advantages).

A plain file referenced by URI keeps the asset inspectable and avoids pickling through an IO manager."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from urllib.parse import urlparse


def write_transitions(path: Path, rows: list, advantages) -> Path:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        f.write(json.dumps({"advantages": dataclasses.asdict(advantages)}) + "\n")
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")
    tmp.replace(path)  # readers never see a half-written file
    return path


def read_transitions(uri: str) -> tuple[list, object]:
    from lightning_dagster.training.advantages import Advantages
    from lightning_dagster.training.transitions import Row

    path = Path(urlparse(uri).path)
    with gzip.open(path, "rt") as f:
        head = json.loads(f.readline())["advantages"]
        rows = [Row(**json.loads(line)) for line in f]
    head["group_stats"] = {k: tuple(v) for k, v in head.get("group_stats", {}).items()}
    return rows, Advantages(**head)
