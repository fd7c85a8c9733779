"""Shared test data: lineage arguments of a candidate and a passing receipt re-pointed at real versions, a
registry bootstrapped with a parent and candidates, and the release's signed steps as the tests take them."""

from __future__ import annotations

import json
from pathlib import Path

EXAMPLE_RECEIPT = Path(__file__).resolve().parents[2] / "examples" / "gate" / "candidate-a.json"


def bootstrap(registry, variant, n_candidates: int = 1):
    """The initial parent (`variant(0)`) and `n_candidates` candidates of it (`variant(1)`, ...)."""
    parent = registry.register_initial_parent(variant(0))
    candidates = [
        registry.log_candidate(variant(k), **candidate_kwargs(parent.version))
        for k in range(1, n_candidates + 1)
    ]
    return parent, candidates


def artifact_files(tracking, run_id: str, name: str) -> list[Path]:
    """Where the artifact store keeps a run's file (SQLite: the artifact root; server: --artifacts-destination)."""
    root = tracking.artifact_root if tracking.server is None else tracking.server.artifacts
    return [p for p in Path(root).rglob(name) if run_id in p.parts]


def candidate_kwargs(parent_version: str, step_count: int = 3) -> dict:
    return {
        "parent_version": parent_version,
        "snapshot_key": "snap-20261130T0800Z-1a2b3c4d",
        "algorithm_config": {"name": "grpo", "lr": 1e-4, "group_size": 8, "optim": {"betas": [0.9, 0.99]}},
        "metrics_per_step": [
            {"reward_mean": 0.3 + 0.05 * s, "loss": 1.0 - 0.1 * s} for s in range(step_count)
        ],
        "train_snapshot": {
            "name": "snap-20261130T0800Z-1a2b3c4d",
            "content_hash": "sha256:" + "1a" * 32,
            "rows": 15,
        },
        "heldout_snapshot": {"name": "holdout-v3", "content_hash": "sha256:" + "5e" * 32, "rows": 120},
        "code_revision": "b18ed42",
        "evaluator_version": "exact-answer 1.4.0",
        "orchestrator_run_id": "dagster-run-1",
    }


def passing_receipt(registry, parent, candidate, receipt_id: str, keys=None, edit=None):
    """The gate fixture's passing receipt A, re-pointed at real registered versions of this test's model,
    with `edit(data)` applied; its canary approval (alice, release-owner) is signed with `keys["alice"]`
    over the edited evidence, or dropped without `keys`."""
    from lightning_dagster.gate import parse_receipt
    from lightning_dagster.gate.receipt import add_approval
    from lightning_dagster.release.receipts import sign_approval

    data = json.loads(EXAMPLE_RECEIPT.read_text())
    data["receipt_id"] = receipt_id
    data["plan"]["parent"]["uri"] = parent.model_uri
    data["plan"]["parent"]["model_version"] = parent.version
    data["plan"]["parent"]["weights_hash"] = parent.weights_hash
    data["candidate"]["model_version"] = candidate.version
    data["candidate"]["uri"] = candidate.model_uri
    data["candidate"]["weights_hash"] = candidate.weights_hash
    (canary,) = data.pop("approvals")
    if edit is not None:
        edit(data)
    receipt = parse_receipt(data)
    if keys is None:
        return receipt
    signed = sign_approval(
        receipt,
        actor=canary["actor"],
        role=canary["role"],
        key=keys[canary["actor"]],
        step="canary",
        at=canary["at"],
    )
    return add_approval(receipt, signed)


def record_as_pipeline(registry, receipt, policy=None):
    """Write `receipt` into the ledger as the pipeline does: the snapshot it belongs to first, then the
    receipt with the gate's verdict under `policy` (default: the packaged one). Returns its id."""
    from lightning_dagster.gate import evaluate, load_policy, parse_receipt
    from lightning_dagster.gate.ledger import RECEIPT_SNAPSHOTS, ReceiptLedger
    from lightning_dagster.gate.receipt import with_gate_record
    from lightning_dagster.pipeline.context import save_doc
    from lightning_dagster.release.roles import registry_roles

    receipt = parse_receipt(receipt) if isinstance(receipt, dict) else receipt
    policy = load_policy(policy)
    judged = with_gate_record(
        receipt, evaluate(receipt, policy, None, roles=registry_roles(registry).actors).to_record()
    )
    key = receipt.receipt_id.removeprefix("rcpt-")
    save_doc(registry.store, RECEIPT_SNAPSHOTS, receipt.receipt_id, {"snapshot_key": key})
    ReceiptLedger(registry.store).append(judged)
    return receipt.receipt_id


def approve(registry, receipt, keys, actor: str, role: str = "release-owner", step: str = "default"):
    """`actor` signs `step` of the receipt (the ledger's head for an id) with their key and records it; a
    receipt given by value is recorded as the pipeline records its receipts first, unless the ledger has it."""
    from lightning_dagster.gate import parse_receipt
    from lightning_dagster.gate.ledger import ReceiptLedger
    from lightning_dagster.release import receipts

    if not isinstance(receipt, str):
        current = parse_receipt(receipt) if isinstance(receipt, dict) else receipt
        if not ReceiptLedger(registry.store).history(current.receipt_id):
            record_as_pipeline(registry, current)
        receipt = current.receipt_id
    current = receipts.load(registry.store, receipt).receipt
    approval = receipts.sign_approval(current, actor=actor, role=role, key=keys[actor], step=step)
    return receipts.approve(registry, receipt, approval)


def signed_rollback(registry, version: str, actor: str, keys, *, role: str = "default-approver", **kw):
    """`actor`'s rollback of approved-default to `version`, signed with `keys[actor]` (`sign_rollback`)."""
    from lightning_dagster.release.rollbacks import sign_rollback

    reason = kw.pop("reason", "back to the parent")
    return sign_rollback(registry, version, actor=actor, role=role, key=keys[actor], reason=reason, **kw)


def signed_move(registry, to: str, keys, actor: str = "alice", *, rollback: bool = False):
    """A move of approved-default made straight in the store, signed as the registry signs a promotion (or,
    with `rollback`, a rollback) by `actor` with `keys[actor]`: what a process that died before its MLflow
    write leaves behind."""
    import time

    from lightning_dagster.release import chain
    from lightning_dagster.release.signing import ROLLBACK, load_private_key, sign

    name, key, at = registry.pointer_name(), load_private_key(keys[actor]), time.time()
    value, seq = registry.store.pointer_state(name)
    version, role = registry.model_version(to), "default-approver"
    if rollback:
        fields = {"pointer": name, "from_version": value, "from_seq": seq, "target_version": to, "actor": actor,
                  "role": role, "reason": "back", "at": at}  # fmt: skip
        note = chain.move_note(version.weights_hash, version.files_hash, kind=chain.ROLLED_BACK, role=role, at=at,
                               reason="back", signed_at=at, signature=sign(key, ROLLBACK, fields))  # fmt: skip
    else:
        note = chain.move_note(version.weights_hash, version.files_hash, kind=chain.PROMOTION, role=role, at=at,
                               receipt_hash=None)  # fmt: skip
        note["signature"] = chain.sign_move(key, name, seq + 1, value, to, actor, None, note)
    body = json.dumps({**note, "note": "rollback" if rollback else "promotion"})
    return registry.store.move_pointer(name, expected=value, expected_seq=seq, to=to, actor=actor, note=body)
