"""The pipeline core without a Dagster run: typed snapshot manifests, the retry policy the fingerprint
names, and pointer operations that refuse receipts the store cannot place."""

from __future__ import annotations

import datetime as dt

import pytest

from lightning_dagster.gate.hashing import content_hash, fingerprint
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.serving import retry_policy
from lightning_dagster.pipeline.snapshots import (
    SnapshotTampered,
    build_manifest,
    load_manifest,
    save_manifest,
    snapshot_key,
    snapshot_refs,
)
from lightning_dagster.pipeline.stages import release
from lightning_dagster.registry.errors import PromotionRefused
from tests.dagster.conftest import pipeline_for, tiny_training


def test_manifest_round_trips_through_the_store_and_names_its_key(embedded_home):
    p = pipeline_for()
    manifest = build_manifest(p, train_seed=7, serve_rollout_ids=["ro-b", "ro-a"])
    key = snapshot_key(manifest.digest, dt.datetime(2026, 11, 30, 8, 0, tzinfo=dt.UTC))
    save_manifest(p, key, manifest)
    loaded = load_manifest(p, key)
    assert loaded == manifest and loaded.serve_rollout_ids == ["ro-a", "ro-b"]
    assert key == f"snap-20261130T0800Z-{manifest.digest[:8]}"
    assert manifest.content_hash == content_hash(manifest.body())
    refs = snapshot_refs(manifest)
    assert refs["holdout"].content_hash == content_hash(manifest.splits.holdout)
    assert refs["train"].n_tasks == len(manifest.splits.train)


def test_closed_sets_are_named_alike_across_snapshots_and_train_sets_are_not(embedded_home):
    p = pipeline_for()
    a, b = (snapshot_refs(build_manifest(p, train_seed=s)) for s in (1, 2))
    assert a["holdout"].snapshot_id == b["holdout"].snapshot_id
    assert a["train"].snapshot_id != b["train"].snapshot_id


def test_a_tampered_manifest_is_refused_on_load(embedded_home):
    p = pipeline_for()
    manifest = build_manifest(p, train_seed=11)
    key = "snap-tampered"
    save_manifest(p, key, manifest)
    body = manifest.model_dump()
    body["splits"]["holdout"][0]["task_id"] = "swapped"
    ctx.save_doc(p.get_store(), ctx.SNAPSHOTS, key, body)
    with pytest.raises(SnapshotTampered, match="no longer hashes"):
        load_manifest(p, key)
    ctx.save_doc(p.get_store(), ctx.SNAPSHOTS, key, {"content_hash": manifest.content_hash})
    with pytest.raises(SnapshotTampered, match="not a manifest"):
        load_manifest(p, key)


def test_retry_policy_fingerprint_is_the_policy_the_runner_uses(embedded_home):
    p = pipeline_for()
    twice = p.model_copy(update={"training": tiny_training(max_attempts=2)})
    assert retry_policy(twice).max_attempts == 2
    prints = ctx.global_fingerprints(twice, None)["retry_policy"]
    assert prints == fingerprint(retry_policy(twice).to_dict())
    assert prints != ctx.global_fingerprints(p, None)["retry_policy"]


def test_promote_refuses_a_receipt_no_snapshot_planned(embedded_home):
    with pytest.raises(PromotionRefused, match="rcpt-unknown"):
        release.promote(pipeline_for(), "rcpt-unknown", "bob")
