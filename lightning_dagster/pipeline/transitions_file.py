"""The training transitions of one snapshot as a gzipped JSON-lines file (rows, then advantages).

A plain file referenced by URI keeps the asset inspectable and avoids pickling through an IO manager. The
first line carries the format `version` (files written before it had none: version 1, the same layout) and the
number of rows, so a truncated file, one of another version, or one whose rows do not fit `Row` raises
`TransitionsFileError` instead of training on part of the data or failing deep inside a constructor."""

from __future__ import annotations

import dataclasses
import gzip
import json
import zlib
from pathlib import Path
from urllib.parse import urlparse

VERSION = 1


class TransitionsFileError(ValueError):
    """A transitions file that is truncated, corrupt, or of another format version."""


def write_transitions(path: Path, rows: list, advantages) -> Path:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        head = {"version": VERSION, "rows": len(rows), "advantages": dataclasses.asdict(advantages)}
        f.write(json.dumps(head) + "\n")
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")
    tmp.replace(path)  # readers never see a half-written file
    return path


def read_transitions(uri: str) -> tuple[list, object]:
    from lightning_dagster.training.advantages import Advantages
    from lightning_dagster.training.transitions import Row

    path = Path(urlparse(uri).path)
    try:
        with gzip.open(path, "rt") as f:
            head = json.loads(f.readline())
            version = head.get("version", 1)
            if version != VERSION:
                raise TransitionsFileError(f"{path}: format version {version!r}, this reader reads {VERSION}")
            rows = [Row(**json.loads(line)) for line in f]
        expected = head.get("rows")
        if expected is not None and expected != len(rows):
            raise TransitionsFileError(f"{path}: {len(rows)} rows, its header announces {expected}")
        adv = head["advantages"]
        adv["group_stats"] = {k: tuple(v) for k, v in adv.get("group_stats", {}).items()}
        return rows, Advantages(**adv)
    except TransitionsFileError:
        raise
    except (OSError, EOFError, zlib.error, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TransitionsFileError(
            f"{path}: not a readable transitions file: {type(exc).__name__}: {exc}"
        ) from exc
