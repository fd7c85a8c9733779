"""Deterministic task sets whose split is a hash of the task's id, so the four splits are disjoint for every
seed and the same (split, n, seed) always gives the same list."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Mapping
from typing import Any

SPLITS = ("train", "holdout", "protected", "canary")


class UnknownSplit(ValueError):
    """A split name outside SPLITS (or outside what a harness offers)."""


def content_hash(content: Mapping[str, Any]) -> str:
    """16 hex digits of sha256 over canonical JSON: stable across runs and Python versions."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def split_of(task_id: str, weights: Mapping[str, float]) -> str:
    """The split a task id hashes into, with the given (not necessarily normalised) weights."""
    bucket = int(hashlib.sha256(f"split:{task_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    total = sum(weights.values())
    edge = 0.0
    for name, weight in weights.items():
        edge += weight / total
        if bucket <= edge:
            return name
    return next(reversed(weights))


def draw_tasks(
    harness: str,
    split: str,
    n: int,
    seed: int,
    candidate: Callable[[random.Random], dict[str, Any]],
    assign: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """`n` distinct tasks of `split` from a stream seeded by (harness, seed); `assign` must be pure."""
    if split not in SPLITS:
        raise UnknownSplit(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"{harness}:{seed}")
    tasks: list[dict[str, Any]] = []
    seen: set[str] = set()
    # Generous bound: the rarest split takes ~10% of candidates; duplicates are rare in these spaces.
    for _ in range(200 * n + 1000):
        if len(tasks) == n:
            return tasks
        content = candidate(rng)
        task_id = content_hash(content)
        task = {"task_id": task_id, **content}
        if task_id in seen or assign(task) != split:
            continue
        seen.add(task_id)
        tasks.append({**task, "split": split})
    if len(tasks) == n:
        return tasks
    raise ValueError(f"{harness}: could not draw {n} distinct {split} tasks (got {len(tasks)})")
