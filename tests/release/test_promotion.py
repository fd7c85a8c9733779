"""Promotion and rollback on both MLflow backends: the 8-process race (exactly one promotion wins), a receipt
promoted only under the policy it was judged by, every refusal of a promotion, and a rollback that restores
the exact parent's bytes."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from mlflow import MlflowClient

from lightning_dagster.engine import checkpoint_hash
from lightning_dagster.registry import APPROVED, PointerConflict, Registry
from lightning_dagster.release import promotion, rollbacks
from lightning_dagster.release.errors import ApprovalRefused, NotAuthorized, PromotionRefused
from lightning_dagster.store import Store
from tests.registry.helpers import approve, bootstrap, candidate_kwargs, passing_receipt, signed_rollback


def _race(
    tracking_uri,
    store_url,
    model_name,
    artifact_root,
    cache,
    roles,
    approver_keys,
    receipt_id,
    actor,
    barrier,
    queue,
):
    registry = Registry(
        tracking_uri, Store(store_url), model_name, artifact_root, cache_dir=cache, roles_file=roles
    )
    registry.reconcile()  # connect and migrate before the start line, so the race is on the move itself
    barrier.wait(timeout=120)
    try:
        result = promotion.promote(registry, receipt_id, actor, key=approver_keys[actor])
        queue.put((receipt_id, "won", result.move.to_value))
    except PointerConflict as exc:
        queue.put((receipt_id, "conflict", str(exc)))
    except Exception as exc:  # reported, so the assertion shows what went wrong
        queue.put((receipt_id, "error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.slow
def test_eight_processes_race_exactly_one_wins(
    registry, variant, store_url, tracking, roles_file, approver_keys
):
    parent, candidates = bootstrap(registry, variant, n_candidates=8)
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
        approver_keys,
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

    parent, (cand,) = bootstrap(registry, variant)
    receipt = passing_receipt(registry, parent, cand, "rec-policy", approver_keys)
    default = load_policy(None)
    judged = with_gate_record(receipt, evaluate(receipt, default).to_record())
    approve(registry, judged, approver_keys, "alice")
    lax = type(default).model_validate({**default.model_dump(), "version": "lax-v1"})
    assert lax.hash != default.hash
    with pytest.raises(PromotionRefused, match=f"judged under policy {default.version}"):
        promotion.promote(registry, "rec-policy", "alice", key=approver_keys["alice"], policy=lax)
    assert [m.to_value for m in registry.history()] == [parent.version]
    assert (
        promotion.promote(
            registry, "rec-policy", "alice", key=approver_keys["alice"], policy=default
        ).move.to_value
        == cand.version
    )


def test_promotion_refusals(registry, variant, approver_keys):
    keys = approver_keys
    parent, (cand, other) = bootstrap(registry, variant, 2)
    receipt = passing_receipt(registry, parent, cand, "rec-refusals", keys)
    with pytest.raises(ApprovalRefused, match="does not hold role"):
        approve(registry, receipt, keys, "bob")  # bob holds only ml-lead
    with pytest.raises(ApprovalRefused, match="not among the deployment's approvers"):
        approve(registry, receipt, keys, "mallory")  # not in the roles at all
    stored = approve(registry, receipt, keys, "alice")
    assert stored.version == 2 and stored.receipt.approvals[-1].actor == "alice"

    with pytest.raises(NotAuthorized):
        promotion.promote(registry, "rec-refusals", "bob", key=approver_keys["bob"])
    with pytest.raises(PromotionRefused, match="void"):
        promotion.promote(
            registry,
            "rec-refusals",
            "alice",
            key=approver_keys["alice"],
            current_fingerprints={"evaluator": "sha256:" + "0" * 64},
        )
    with pytest.raises(PromotionRefused, match="differs from the ledger"):
        promotion.promote(
            registry, receipt, "alice", key=approver_keys["alice"]
        )  # version 1, not the ledger's head

    def unverified(data):
        data["canary"]["tasks"][0]["verified"] = False

    held = passing_receipt(registry, parent, cand, "rec-hold", keys, edit=unverified)
    approve(registry, held, keys, "alice")
    with pytest.raises(PromotionRefused, match="check 6"):
        promotion.promote(registry, "rec-hold", "alice", key=approver_keys["alice"])

    # A passing receipt whose parent is not the approved default: the compare-and-set refuses the move.
    wrong_parent = passing_receipt(registry, cand, other, "rec-wrong-parent", keys)
    approve(registry, wrong_parent, keys, "alice")
    with pytest.raises(PointerConflict):
        promotion.promote(registry, "rec-wrong-parent", "alice", key=approver_keys["alice"])
    assert [m.to_value for m in registry.history()] == [parent.version]

    result = promotion.promote(registry, "rec-refusals", "alice", key=approver_keys["alice"])
    assert result.mirrored and result.move.to_value == cand.version
    with pytest.raises(PointerConflict):  # the same receipt again: its parent is no longer approved
        promotion.promote(registry, "rec-refusals", "alice", key=approver_keys["alice"])


def test_rollback_restores_the_exact_parent(registry, variant, approver_keys):
    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-rb", approver_keys), approver_keys, "alice"
    )
    promotion.promote(registry, "rec-rb", "alice", key=approver_keys["alice"])
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
        rollbacks.rollback(registry, signed_rollback(registry, newer.version, "alice", approver_keys))
    with pytest.raises(
        NotAuthorized
    ):  # rollback goes back, never to "the newest"; bob is no default-approver
        rollbacks.rollback(registry, signed_rollback(registry, parent.version, "bob", approver_keys))

    result = rollbacks.rollback(registry, signed_rollback(registry, parent.version, "alice", approver_keys))
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
