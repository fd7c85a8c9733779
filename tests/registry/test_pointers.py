"""The two pointers on both MLflow backends: lineage, resolution, a mirror repaired, a reused version number."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from lightning_dagster.engine import checkpoint_hash
from lightning_dagster.registry import (
    APPROVED,
    LATEST,
    PointerNotSet,
    Registry,
    WeightsMismatch,
)
from lightning_dagster.registry.lineage import DIGEST_CHARS, register_version
from lightning_dagster.store import Store
from tests.registry.helpers import artifact_files, bootstrap, signed_move


def test_lineage_run_and_version_tags(registry, variant, tracking):
    parent, (cand,) = bootstrap(registry, variant)
    client = MlflowClient(tracking.uri, tracking.uri)
    run = client.get_run(cand.run_id)
    assert run.data.params["lr"] == "0.0001" and run.data.params["optim.betas"] == "[0.9, 0.99]"
    rewards = client.get_metric_history(cand.run_id, "reward_mean")
    assert [(m.step, round(m.value, 3)) for m in rewards] == [(0, 0.3), (1, 0.35), (2, 0.4)]
    inputs = {d.dataset.name: d for d in run.inputs.dataset_inputs}
    assert set(inputs) == {"snap-20261130T0800Z-1a2b3c4d", "holdout-v3"}
    assert inputs["holdout-v3"].dataset.digest == ("5e" * 32)[:DIGEST_CHARS]
    assert json.loads(inputs["holdout-v3"].dataset.source)["content_hash"] == "sha256:" + "5e" * 32
    assert {t.value for d in inputs.values() for t in d.tags} == {"training", "evaluation"}
    names = {a.path for a in client.list_artifacts(cand.run_id)}
    assert names == {"checkpoint", "plots"}
    png = artifact_files(tracking, cand.run_id, "training.png")
    assert png and png[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    mv = client.get_model_version(registry.model_name, cand.version)
    assert mv.tags["parent_version"] == parent.version
    assert mv.tags["parent_weights_hash"] == parent.weights_hash == checkpoint_hash(variant(0))
    assert mv.tags["weights_hash"] == cand.weights_hash == checkpoint_hash(variant(1))
    assert mv.tags["snapshot_key"] == "snap-20261130T0800Z-1a2b3c4d"
    assert mv.tags["orchestrator_run_id"] == "dagster-run-1" and mv.tags["code_revision"] == "b18ed42"
    assert registry.current(LATEST) == cand.version


def test_approved_default_is_never_latest_candidate(make_registry, variant, new_store_url, tracking):
    first = make_registry()
    parent, (cand,) = bootstrap(first, variant)
    resolved = first.resolve(APPROVED)
    assert resolved.version == parent.version != first.resolve(LATEST, download=False).version == cand.version
    assert checkpoint_hash(resolved.local_path) == checkpoint_hash(variant(0))

    # Same MLflow model, a store in which approved-default was never set: MLflow's alias (and the
    # latest-candidate alias) must not stand in for it, and the stray alias is removed.
    other = Registry(
        tracking.uri,
        Store(new_store_url()),
        first.model_name,
        tracking.artifact_root,
        cache_dir=first.cache_dir,
    )
    with pytest.raises(PointerNotSet):
        other.resolve(APPROVED)
    assert (
        MlflowClient(tracking.uri, tracking.uri).get_registered_model(first.model_name).aliases.get(APPROVED)
        is None
    )
    assert other.resolve(LATEST, download=False).version == cand.version


def test_never_set_pointer_raises(registry, variant):
    registry.reconcile()
    with pytest.raises(PointerNotSet):
        registry.resolve(APPROVED)
    with pytest.raises(PointerNotSet):
        registry.resolve(LATEST)
    with pytest.raises(ValueError, match="reserved"):
        registry.resolve("latest")


def test_tampered_artifact_fails_the_weights_hash(registry, variant, tracking):
    parent, _ = bootstrap(registry, variant, n_candidates=0)
    (weights,) = artifact_files(tracking, parent.run_id, "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(WeightsMismatch):
        registry.download(parent.version)


def test_reconcile_repairs_a_mirror_left_behind(registry, variant, tracking, approver_keys):
    """A promotion that died after the store's move but before MLflow's write is repaired by the next call."""
    parent, (cand,) = bootstrap(registry, variant)
    signed_move(registry, cand.version, approver_keys)
    rm = MlflowClient(tracking.uri, tracking.uri).get_registered_model(registry.model_name)
    assert str(rm.aliases[APPROVED]) == parent.version  # the mirror is behind
    assert registry.resolve(APPROVED, download=False).version == cand.version
    rm = MlflowClient(tracking.uri, tracking.uri).get_registered_model(registry.model_name)
    assert str(rm.aliases[APPROVED]) == cand.version
    mv = MlflowClient(tracking.uri, tracking.uri).get_model_version(registry.model_name, cand.version)
    assert mv.tags[f"{APPROVED}.seq"] == str(registry.history()[-1].seq)
    assert mv.tags[f"{APPROVED}.approved_by"] == "alice"
    assert not registry.reconcile().changed


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_reused_version_number_is_caught_by_the_weights_hash(registry, variant, tracking):
    """Re-creating the registered model restarts versions at 1: the pointer's '1' is now other weights."""
    parent = registry.register_initial_parent(variant(0))
    MlflowClient(tracking.uri, tracking.uri).delete_registered_model(registry.model_name)
    recreated = Registry(
        tracking.uri,
        registry.store,
        registry.model_name,
        tracking.artifact_root,
        cache_dir=registry.cache_dir,
    )
    impostor = register_version(recreated, variant(1), run_name="impostor", tags={}, params={})
    assert impostor.version == parent.version and impostor.weights_hash != parent.weights_hash
    with pytest.raises(WeightsMismatch):
        recreated.resolve(APPROVED)
    rm = MlflowClient(tracking.uri, tracking.uri).get_registered_model(registry.model_name)
    assert APPROVED not in rm.aliases  # the mirror was not pointed at the impostor either
