"""Snapshots: the task sets of one partition, frozen by content hash in the store.

Train tasks (and the serve rollouts a sensor saw) change from snapshot to snapshot; the held-out and
protected sets are closed: drawn with the evaluation seed, identical for every snapshot, so candidates of
different snapshots are judged on the same cases.
"""

from __future__ import annotations

import hashlib
from typing import Any

from lightning_dagster.pipeline import context as ctx


class SnapshotTampered(ValueError):
    """A stored snapshot no longer hashes to the content hash it was frozen with."""


def build_manifest(p: Any, *, train_seed: int, serve_rollout_ids: list[str] | None = None) -> dict:
    """The task sets a snapshot freezes, with a content hash over all of them."""
    from lightning_dagster.gate.hashing import content_hash

    t, spec = p.training, ctx.harness(p.model.harness)
    canary_name = ctx.canary_harness(p)
    splits = {
        "train": spec.make_tasks("train", t.steps * t.tasks_per_step, train_seed),
        "holdout": spec.make_tasks("holdout", t.holdout_tasks, t.eval_seed),
        "protected": spec.make_tasks("protected", t.protected_tasks, t.eval_seed),
        "canary": ctx.harness(canary_name).make_tasks("canary", t.canary_tasks, train_seed),
    }
    body = {
        "harness": p.model.harness,
        "canary_harness": canary_name,
        "train_seed": train_seed,
        "splits": splits,
        "serve_rollout_ids": sorted(serve_rollout_ids or []),
    }
    return {
        **body,
        "split_hashes": {k: content_hash(v) for k, v in splits.items()},
        "content_hash": content_hash(body),
    }


def _verified(manifest: dict) -> dict:
    from lightning_dagster.gate.hashing import content_hash

    body = {
        k: manifest[k] for k in ("harness", "canary_harness", "train_seed", "splits", "serve_rollout_ids")
    }
    if content_hash(body) != manifest["content_hash"]:
        raise SnapshotTampered(f"snapshot content no longer hashes to {manifest['content_hash']}")
    return manifest


def save_manifest(p: Any, key: str, manifest: dict) -> None:
    ctx.save_doc(p.get_store(), ctx.SNAPSHOTS, key, manifest)


def freeze_tasks(p: Any, key: str) -> dict:
    """The snapshot's manifest: the one a sensor froze when it cut the key, or (for a partition added by
    hand in the UI) one frozen now from the key's own seed."""
    store = p.get_store()
    manifest = ctx.load_doc(store, ctx.SNAPSHOTS, key)
    if manifest is None:
        seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 1_000_000
        manifest = build_manifest(p, train_seed=seed)
        save_manifest(p, key, manifest)
    return _verified(manifest)


def load_manifest(p: Any, key: str) -> dict:
    manifest = ctx.load_doc(p.get_store(), ctx.SNAPSHOTS, key)
    if manifest is None:
        raise ctx.StageMissing(key, "tasks")
    return _verified(manifest)


def snapshot_refs(manifest: dict) -> dict[str, Any]:
    from lightning_dagster.gate.receipt import SnapshotRef

    refs = {}
    for split, items in manifest["splits"].items():
        digest = manifest["split_hashes"][split]
        # Closed sets are named by content (the same for every snapshot); train sets by the snapshot.
        name = (
            f"{split}-{digest.split(':')[-1][:12]}"
            if split in ("holdout", "protected")
            else f"{split}-{manifest['content_hash'].split(':')[-1][:12]}"
        )
        refs[split] = SnapshotRef(snapshot_id=name, content_hash=digest, n_tasks=len(items))
    return refs
