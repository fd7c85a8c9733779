"""The training transitions of one snapshot as a gzipped JSON-lines file (rows, then advantages).

The first line carries the format `version` (none: version 1), the number of rows, the tokenizer's
fingerprint and the excluded rollouts. A truncated file, one of another version, or one whose rows do not
fit `Row` raises `TransitionsFileError`; read for a trainer with another tokenizer, `TokenizerMismatch`.
A file without a fingerprint (written before they were recorded) is read with a warning.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

VERSION = 1

log = logging.getLogger(__name__)


class TransitionsFileError(ValueError):
    """A transitions file that is truncated, corrupt, or of another format version."""


class TokenizerMismatch(ValueError):
    """A transitions file built with another tokenizer than the trainer's: its ids would mean other tokens."""

    def __init__(self, message: str, *, recorded: str = "", expected: str = "") -> None:
        super().__init__(message)
        self.recorded, self.expected = recorded, expected


@dataclass
class TransitionsFile:
    rows: list
    advantages: Any
    tokenizer: str | None  # None: written before fingerprints were recorded
    excluded: list[dict] = field(default_factory=list)  # rollout_id, span_id, reason of each left out


def write_transitions(
    path: Path, rows: list, advantages, *, tokenizer: str, excluded: Sequence[Any] = ()
) -> Path:
    """`tokenizer`: the fingerprint of the tokenizer that produced the rows' ids; `excluded`: the rollouts
    left out (`transitions.ExcludedRollout`), recorded so the file says what it does not hold."""
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        head = {
            "version": VERSION,
            "rows": len(rows),
            "tokenizer": tokenizer,
            "excluded": [dataclasses.asdict(e) for e in excluded],
            "advantages": dataclasses.asdict(advantages),
        }
        f.write(json.dumps(head) + "\n")
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")
    tmp.replace(path)  # readers never see a half-written file
    return path


def check_tokenizer(path: Path | str, recorded: str | None, expected: str) -> None:
    """Raise `TokenizerMismatch` when the file's fingerprint is not the trainer's; warn when it has none."""
    if recorded is None:
        log.warning(
            "%s records no tokenizer fingerprint (written before they were): it cannot be checked against "
            "the trainer's tokenizer %s; re-materialize training_transitions to rebuild it with one",
            path,
            expected,
        )
        return
    if recorded != expected:
        raise TokenizerMismatch(
            f"{path}: built with tokenizer {recorded}, the trainer's tokenizer is {expected}: its token ids "
            "would mean other tokens; rebuild the transitions from spans of this model's tokenizer",
            recorded=recorded,
            expected=expected,
        )


def load_transitions(uri: str, *, tokenizer: str | None = None) -> TransitionsFile:
    """The whole file; with `tokenizer` (the trainer's fingerprint) checked by `check_tokenizer` first."""
    from lightning_dagster.training.advantages import Advantages
    from lightning_dagster.training.transitions import Row

    path = Path(urlparse(uri).path)
    try:
        with gzip.open(path, "rt") as f:
            head = json.loads(f.readline())
            version = head.get("version", 1)
            if version != VERSION:
                raise TransitionsFileError(f"{path}: format version {version!r}, this reader reads {VERSION}")
            recorded = head.get("tokenizer")
            if recorded is not None and not isinstance(recorded, str):
                raise TransitionsFileError(f"{path}: tokenizer fingerprint {recorded!r} is not a string")
            if tokenizer is not None:
                check_tokenizer(path, recorded, tokenizer)
            rows = [Row(**json.loads(line)) for line in f]
        expected = head.get("rows")
        if expected is not None and expected != len(rows):
            raise TransitionsFileError(f"{path}: {len(rows)} rows, its header announces {expected}")
        adv = head["advantages"]
        adv["group_stats"] = {k: tuple(v) for k, v in adv.get("group_stats", {}).items()}
        return TransitionsFile(rows, Advantages(**adv), recorded, list(head.get("excluded", [])))
    except (TransitionsFileError, TokenizerMismatch):
        raise
    except (OSError, EOFError, zlib.error, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TransitionsFileError(
            f"{path}: not a readable transitions file: {type(exc).__name__}: {exc}"
        ) from exc
