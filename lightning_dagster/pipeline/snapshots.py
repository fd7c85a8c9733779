"""Snapshots: the task sets of one partition, frozen by content hash in the store, and their keys.

Train tasks change from snapshot to snapshot; the held-out and protected sets are drawn with the evaluation
seed, identical for every snapshot of one dataset, so candidates of different snapshots are judged on the
same cases. The manifest records the dataset's content hash, so the key changes when any row does.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ValidationError

from lightning_dagster.gate.hashing import canonical_json, content_hash
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.training.selection import train_tasks

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import SnapshotRef
    from lightning_dagster.pipeline.run import Pipeline

Split = Literal["train", "holdout", "protected", "canary"]
CLOSED_SPLITS: tuple[Split, ...] = ("holdout", "protected")  # the same cases for every snapshot

# Letters, digits, `.`, `_` and `-` only: the UI and backfills misbehave on commas, pipes and brackets. The
# first is a letter or digit: the key names directories (`snapshots/<key>`, `candidates/<key>`), where `.`
# and `..` would be the parent's own folder or its parent.
SNAPSHOT_KEY_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_HEX = re.compile(r"[0-9a-f]{8,}")


class InvalidSnapshotKey(ValueError):
    """A snapshot key the `snapshots` partitions refuse."""


class SnapshotTampered(ValueError):
    """A stored snapshot is not a manifest, or its tasks no longer hash to the digest it was cut or frozen with."""


def validate_snapshot_key(key: str) -> str:
    if not isinstance(key, str) or not SNAPSHOT_KEY_PATTERN.match(key):
        raise InvalidSnapshotKey(
            f"snapshot key {key!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return key


def snapshot_key(digest: str, at: dt.datetime) -> str:
    """`snap-20261130T0800Z-1a2b3c4d`: minute of the cut (UTC) and the first 8 hex digits of the digest."""
    if not _HEX.fullmatch(digest):
        raise InvalidSnapshotKey(f"digest {digest!r} is not lowercase hex")
    stamp = at.astimezone(dt.UTC).strftime("%Y%m%dT%H%MZ")
    return validate_snapshot_key(f"snap-{stamp}-{digest[:8]}")


def _digest(obj: Any) -> str:
    """Hex sha256 over the canonical JSON: the part of a content hash that names and seeds things."""
    return hashlib.sha256(canonical_json(obj)).hexdigest()


class Splits(BaseModel):
    model_config = {"extra": "forbid", "frozen": True}

    train: list[dict[str, Any]]
    holdout: list[dict[str, Any]]
    protected: list[dict[str, Any]]
    canary: list[dict[str, Any]]


class Dataset(BaseModel):
    """The user project a snapshot drew its tasks from, as it was when the snapshot was cut."""

    model_config = {"extra": "forbid", "frozen": True}

    project: str
    harness_kind: str
    path: str
    content_hash: str
    rows: dict[Split, dict[str, int]]


class Manifest(BaseModel):
    """What a snapshot froze: its task sets, the serve rollouts it drew on, and hex digests over them."""

    model_config = {"extra": "forbid", "frozen": True}

    harness: str
    canary_harness: str
    train_seed: int
    splits: Splits
    serve_rollout_ids: list[str]
    dataset: Dataset | None = None  # None: a manifest stored before tasks came from project datasets
    split_digests: dict[Split, str]
    digest: str  # over every field above except `split_digests`

    def body(self) -> dict[str, Any]:
        body = self.model_dump(exclude={"digest", "split_digests"})
        if body["dataset"] is None:
            del body["dataset"]  # such a manifest hashes as it did when it was stored
        return body

    @property
    def content_hash(self) -> str:
        return f"sha256:{self.digest}"

    def split_hash(self, split: Split) -> str:
        return f"sha256:{self.split_digests[split]}"

    def verified(self) -> Manifest:
        body = self.body()
        if content_hash(body) != self.content_hash or any(
            _digest(items) != self.split_digests[split] for split, items in body["splits"].items()
        ):
            raise SnapshotTampered(f"snapshot content no longer hashes to {self.content_hash}")
        return self

    @property
    def base_seed(self) -> int:
        """The base sampling seed (`training.loop.step_seed(base_seed, step)`), from the content only, not where
        the tasks file lay: a re-materialization, or the same data anywhere, samples the same rollouts."""
        return int(_digest([self.train_seed, self.split_digests, self.serve_rollout_ids])[:6], 16)


def build_manifest(p: Pipeline, *, train_seed: int, serve_rollout_ids: list[str] | None = None) -> Manifest:
    """The task sets a snapshot freezes, with digests over all of them (an empty split: `TaskDataError`)."""
    t, source = ctx.settings(p).training, ctx.harness_source(p)
    tasks = source.dataset
    wanted = {"train": t.steps * t.tasks_per_step, "holdout": t.holdout_tasks, "protected": t.protected_tasks}
    tasks.require_splits([split for split, n in {**wanted, "canary": t.canary_tasks}.items() if n > 0])
    splits = Splits(
        # the validation cases checkpoint selection decodes are held back from the train tasks
        train=train_tasks(
            tasks, wanted["train"], train_seed, validation=t.validation_tasks, eval_seed=t.eval_seed
        ),
        holdout=tasks.draw("holdout", wanted["holdout"], t.eval_seed),
        protected=tasks.draw("protected", wanted["protected"], t.eval_seed),
        canary=tasks.draw("canary", t.canary_tasks, train_seed),  # the canary runs this project too
    )
    body: dict[str, Any] = {
        "harness": source.name,
        "canary_harness": source.name,
        "train_seed": train_seed,
        "splits": splits.model_dump(),
        "serve_rollout_ids": sorted(serve_rollout_ids or []),
    }
    body["dataset"] = Dataset(
        project=source.project.name,
        harness_kind=source.project.harness.kind,
        path=str(tasks.file),
        content_hash=tasks.content_hash,
        rows={split: dict(sorted(tasks.families(split).items())) for split in tasks.splits},
    ).model_dump()
    digests = {split: _digest(items) for split, items in body["splits"].items()}
    return Manifest(**body, split_digests=digests, digest=_digest(body))


def save_manifest(p: Pipeline, key: str, manifest: Manifest) -> None:
    ctx.save_doc(p.get_store(), ctx.SNAPSHOTS, key, manifest.model_dump())


def _stored(p: Pipeline, key: str) -> Manifest | None:
    body = ctx.load_doc(p.get_store(), ctx.SNAPSHOTS, key)
    if body is None:
        return None
    try:
        return Manifest.model_validate(body).verified()
    except ValidationError as exc:
        raise SnapshotTampered(f"snapshot {key}: the stored document is not a manifest: {exc}") from exc


def freeze_tasks(p: Pipeline, key: str, cut: dict[str, Any] | None = None) -> Manifest:
    """The snapshot's manifest, frozen by the first run of its `tasks`: from the `cut` the sensor or schedule
    decided (train seed and serve rollouts; `SnapshotTampered` when the tasks changed since, so the key's
    digest no longer matches), or, for a partition added by hand in the UI, from the key's own seed."""
    manifest = _stored(p, key)
    if manifest is None:
        if cut:
            manifest = build_manifest(
                p, train_seed=cut["train_seed"], serve_rollout_ids=cut["serve_rollout_ids"]
            )
            if not key.endswith(f"-{manifest.digest[:8]}"):
                raise SnapshotTampered(
                    f"snapshot {key}: the task pool changed after it was cut (its tasks now hash to "
                    f"{manifest.digest[:8]}); the next sensor tick cuts a snapshot of the changed pool"
                )
        else:
            seed = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 1_000_000
            manifest = build_manifest(p, train_seed=seed)
        save_manifest(p, key, manifest)
    return manifest


def load_manifest(p: Pipeline, key: str) -> Manifest:
    manifest = _stored(p, key)
    if manifest is None:
        raise ctx.StageMissing(key, "tasks")
    return manifest


def snapshot_refs(manifest: Manifest) -> dict[Split, SnapshotRef]:
    from lightning_dagster.gate.receipt import SnapshotRef

    refs: dict[Split, SnapshotRef] = {}
    for split, items in manifest.splits:
        # Closed sets are named by content (the same for every snapshot); train sets by the snapshot.
        digest = manifest.split_digests[split] if split in CLOSED_SPLITS else manifest.digest
        refs[split] = SnapshotRef(
            snapshot_id=f"{split}-{digest[:12]}",
            content_hash=manifest.split_hash(split),
            n_tasks=len(items),
            # the canary's task ids: check 6 holds it to these
            task_ids=[item["task_id"] for item in items] if split == "canary" else None,
        )
    return refs
