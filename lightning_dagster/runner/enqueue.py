"""Turn harness tasks into queued rollouts: one GRPO group of `group_size` rollouts per task."""

from __future__ import annotations

import hashlib
from typing import Any

from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.store import Store
from lightning_dagster.types import Rollout, RolloutKind, Sampling, new_id


def sampling_seed(seed: int, task_id: str, index: int) -> int:
    """A per-rollout seed, so a parent and its candidate compare on common random numbers."""
    digest = hashlib.sha256(f"{seed}:{task_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def enqueue_tasks(
    store: Store,
    spec: HarnessSpec,
    tasks: list[dict[str, Any]],
    *,
    kind: str | RolloutKind,
    group_size: int = 1,
    seed: int | None = 0,
    resource_id: str | None = None,
    snapshot_key: str | None = None,
    sampling: Sampling | None = None,
    tag: str | None = None,
) -> list[Rollout]:
    """Queue a group of `group_size` rollouts per task, in order (`sampling`: applied by the gateway to
    every call; `tag`: group ids `<tag>-g<task index>` instead of random ones)."""
    rollouts = []
    for t, task in enumerate(tasks):
        group_id = f"{tag}-g{t}" if tag else new_id("grp")
        for i in range(group_size):
            metadata: dict[str, Any] = {"family": task["family"]}
            if seed is not None:
                metadata["sampling_seed"] = sampling_seed(seed, task["task_id"], i)
            if sampling is not None:
                metadata["sampling"] = sampling.model_dump()
            rollouts.append(
                Rollout(
                    kind=RolloutKind(kind),
                    task_id=task["task_id"],
                    task=task,
                    snapshot_key=snapshot_key,
                    group_id=group_id,
                    resource_id=resource_id,
                    harness=spec.name,
                    metadata=metadata,
                )
            )
    return store.enqueue_rollouts(rollouts)


def run_rollouts(store: Store, tag: str, n_tasks: int) -> list[Rollout]:
    """The rollouts `enqueue_tasks(..., tag=tag)` queued for `n_tasks` tasks (empty: none yet)."""
    return store.query_rollouts(group_ids=[f"{tag}-g{t}" for t in range(n_tasks)])
