"""The two pointers on both MLflow backends: lineage, resolution, promotion, the 8-process race, rollback."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_dagster.engine import checkpoint_hash
from lightning_dagster.registry import (
    APPROVED,
    LATEST,
    NotAuthorized,
    PointerConflict,
    PointerNotSet,
    PromotionRefused,
    Registry,
    WeightsMismatch,
)
from lightning_dagster.registry.errors import ApprovalRefused
from lightning_dagster.registry.lineage import DIGEST_CHARS, register_version
from lightning_dagster.store import Store
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt, signed_rollback


def _bootstrap(registry, variant, n_candidates: int = 1):
    parent = registry.register_initial_parent(variant(0))
    candidates = [
        registry.log_candidate(variant(k), **candidate_kwargs(parent.version))
        for k in range(1, n_candidates + 1)
    ]
    return parent, candidates


def _artifact_files(tracking, run_id: str, name: str) -> list[Path]:
    """Where the artifact store keeps a run's file (SQLite: the artifact root; server: --artifacts-destination)."""
    root = tracking.artifact_root if tracking.server is None else tracking.server.artifacts
    return [p for p in Path(root).rglob(name) if run_id in p.parts]


def test_lineage_run_and_version_tags(registry, variant, tracking):
    parent, (cand,) = _bootstrap(registry, variant)
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
    png = _artifact_files(tracking, cand.run_id, "training.png")
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
    parent, (cand,) = _bootstrap(first, variant)
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
    parent, _ = _bootstrap(registry, variant, n_candidates=0)
    (weights,) = _artifact_files(tracking, parent.run_id, "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(WeightsMismatch):
        registry.download(parent.version)


def _race(
    tracking_uri, store_url, model_name, artifact_root, cache, roles, receipt_id, actor, barrier, queue
):
    registry = Registry(
        tracking_uri, Store(store_url), model_name, artifact_root, cache_dir=cache, roles_file=roles
    )
    registry.reconcile()  # connect and migrate before the start line, so the race is on the move itself
    barrier.wait(timeout=120)
    try:
        result = registry.promote(receipt_id, actor)
        queue.put((receipt_id, "won", result.move.to_value))
    except PointerConflict as exc:
        queue.put((receipt_id, "conflict", str(exc)))
    except Exception as exc:  # reported, so the assertion shows what went wrong
        queue.put((receipt_id, "error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.slow
def test_eight_processes_race_exactly_one_wins(
    registry, variant, store_url, tracking, roles_file, approver_keys
):
    parent, candidates = _bootstrap(registry, variant, n_candidates=8)
    for i, cand in enumerate(candidates):
        receipt = passing_receipt(registry, parent, cand, f"rec-race-{i}", approver_keys)
        approve(registry, receipt, approver_keys, f"racer{i}")
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(8), ctx.Queue()
    args = (
        tracking.uri,
        store_url,
        registry.model_name,
        tracking.artifact_root,
        registry.cache_dir,
        roles_file,
    )
    procs = [
        ctx.Process(target=_race, args=(*args, f"rec-race-{i}", f"racer{i}", barrier, queue))
        for i in range(8)
    ]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    outcomes = sorted(r[1] for r in results)
    assert outcomes == ["conflict"] * 7 + ["won"], results
    winner = next(r for r in results if r[1] == "won")
    history = registry.history()
    assert [m.to_value for m in history] == [parent.version, winner[2]]
    assert history[-1].from_value == parent.version and history[-1].receipt_id == winner[0]
    assert registry.resolve(APPROVED, download=False).version == winner[2]
    rm = MlflowClient(tracking.uri, tracking.uri).get_registered_model(registry.model_name)
    assert str(rm.aliases[APPROVED]) == winner[2]
    assert [e["to"] for e in json.loads(rm.tags[f"{APPROVED}.history"])] == [parent.version, winner[2]]


def test_a_receipt_judged_under_one_policy_cannot_be_promoted_under_another(registry, variant, approver_keys):
    from lightning_dagster.gate import evaluate, load_policy
    from lightning_dagster.gate.receipt import with_gate_record

    parent, (cand,) = _bootstrap(registry, variant)
    receipt = passing_receipt(registry, parent, cand, "rec-policy", approver_keys)
    default = load_policy(None)
    judged = with_gate_record(receipt, evaluate(receipt, default).to_record())
    approve(registry, judged, approver_keys, "alice")
    lax = type(default).model_validate({**default.model_dump(), "version": "lax-v1"})
    assert lax.hash != default.hash
    with pytest.raises(PromotionRefused, match=f"judged under policy {default.version}"):
        registry.promote("rec-policy", "alice", policy=lax)
    assert [m.to_value for m in registry.history()] == [parent.version]
    assert registry.promote("rec-policy", "alice", policy=default).move.to_value == cand.version


def test_promotion_refusals(registry, variant, approver_keys):
    keys = approver_keys
    parent, (cand, other) = _bootstrap(registry, variant, 2)
    receipt = passing_receipt(registry, parent, cand, "rec-refusals", keys)
    with pytest.raises(ApprovalRefused, match="does not hold role"):
        approve(registry, receipt, keys, "bob")  # bob holds only ml-lead
    with pytest.raises(ApprovalRefused, match="not among the deployment's approvers"):
        approve(registry, receipt, keys, "mallory")  # not in the roles at all
    stored = approve(registry, receipt, keys, "alice")
    assert stored.version == 2 and stored.receipt.approvals[-1].actor == "alice"

    with pytest.raises(NotAuthorized):
        registry.promote("rec-refusals", "bob")
    with pytest.raises(PromotionRefused, match="void"):
        registry.promote("rec-refusals", "alice", current_fingerprints={"evaluator": "sha256:" + "0" * 64})
    with pytest.raises(PromotionRefused, match="differs from the ledger"):
        registry.promote(receipt, "alice")  # version 1, not the ledger's head

    def unverified(data):
        data["canary"]["tasks"][0]["verified"] = False

    held = passing_receipt(registry, parent, cand, "rec-hold", keys, edit=unverified)
    approve(registry, held, keys, "alice")
    with pytest.raises(PromotionRefused, match="check 6"):
        registry.promote("rec-hold", "alice")

    # A passing receipt whose parent is not the approved default: the compare-and-set refuses the move.
    wrong_parent = passing_receipt(registry, cand, other, "rec-wrong-parent", keys)
    approve(registry, wrong_parent, keys, "alice")
    with pytest.raises(PointerConflict):
        registry.promote("rec-wrong-parent", "alice")
    assert [m.to_value for m in registry.history()] == [parent.version]

    result = registry.promote("rec-refusals", "alice")
    assert result.mirrored and result.move.to_value == cand.version
    with pytest.raises(PointerConflict):  # the same receipt again: its parent is no longer approved
        registry.promote("rec-refusals", "alice")


def test_rollback_restores_the_exact_parent(registry, variant, approver_keys):
    parent, (cand,) = _bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-rb", approver_keys), approver_keys, "alice"
    )
    registry.promote("rec-rb", "alice")
    assert checkpoint_hash(registry.resolve(APPROVED).local_path) == cand.weights_hash

    drill = registry.rollback_drill(parent.version)
    assert drill.ok and drill.hash_ok and drill.loaded and drill.served, drill
    evidence = drill.to_receipt_drill("res-parent")
    assert (evidence.resolved, evidence.loaded, evidence.routed_back) == (True, True, True)
    (recorded,) = registry.store.document_versions(
        "rollback_drills", f"{registry.model_name}/{parent.version}"
    )
    assert recorded.body["served"] and recorded.body["weights_hash"] == parent.weights_hash
    assert registry.current(APPROVED) == cand.version  # the drill never moves the pointer

    newer = registry.log_candidate(variant(2), **candidate_kwargs(cand.version))
    with pytest.raises(PromotionRefused, match="never approved"):
        registry.rollback(signed_rollback(registry, newer.version, "alice", approver_keys))
    with pytest.raises(
        NotAuthorized
    ):  # rollback goes back, never to "the newest"; bob is no default-approver
        registry.rollback(signed_rollback(registry, parent.version, "bob", approver_keys))

    result = registry.rollback(signed_rollback(registry, parent.version, "alice", approver_keys))
    assert result.mirrored and result.move.actor == "alice"
    assert [(m.from_value, m.to_value) for m in registry.history()] == [
        (None, parent.version),
        (parent.version, cand.version),
        (cand.version, parent.version),
    ]
    restored = registry.resolve(APPROVED).local_path
    original = variant(0)
    for f in sorted(p.name for p in original.iterdir()):
        assert (restored / f).read_bytes() == (original / f).read_bytes(), f


def test_reconcile_repairs_a_mirror_left_behind(registry, variant, tracking):
    """A promotion that died after the store's move but before MLflow's write is repaired by the next call."""
    parent, (cand,) = _bootstrap(registry, variant)
    registry.store.move_pointer(
        registry.pointer_name(), expected=parent.version, to=cand.version, actor="alice", note="{}"
    )
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
