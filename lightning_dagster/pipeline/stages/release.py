"""The `release` stages: the rollback drill, the gate's checks and verdict, and the pointer operations an
authorized actor runs (approve, promote, roll back)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.evidence import first_batch, with_rollout_evidence
from lightning_dagster.pipeline.report import markdown_checks
from lightning_dagster.pipeline.results import CheckOutcome, Markdown, StageResult
from lightning_dagster.types import RolloutKind

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import Approval, Receipt
    from lightning_dagster.pipeline.run import Pipeline
    from lightning_dagster.release.promotion import PromoteRequest
    from lightning_dagster.release.rollbacks import RollbackRequest

# Checks judged on the first batch alone, where their asset sits: coverage and retry debt of the rollouts
# sampled from the parent. `release_receipt` judges them again over every rollout against the full plan.
FIRST_BATCH_CHECKS = frozenset({Check.span_coverage, Check.retry_debt})


def rollback_drill(p: Pipeline, key: str) -> StageResult:
    """The registry's drill: resolve, verify bytes, load and serve the exact parent; the pointer stays."""
    from lightning_dagster.gate import receipt as R

    store, reg = p.get_store(), ctx.registry(p)
    receipt = ctx.head_receipt(store, key)
    parent = receipt.plan.parent
    result = reg.rollback_drill(ctx.registered_version(parent), serving=ctx.settings(p).serving)
    drill = result.to_receipt_drill(parent.resource_id)
    stored = ctx.append_receipt(store, key, R.add_rollback_drill(receipt, drill))
    metadata = {
        "parent": parent.uri,
        "resolved": drill.resolved,
        "bytes_verified": result.hash_ok,
        "loaded": drill.loaded,
        "served": drill.routed_back,
        "seconds": result.seconds,
        "error": result.error,
        "approvals": [a.model_dump() for a in receipt.approvals],
        "receipt_version": stored.version,
    }
    return StageResult(metadata)


def reverified_receipt(p: Pipeline, key: str) -> Receipt:
    """The receipt as the gate must see it: the ledger head with phase 2 rebuilt from the store over every
    rollout of the snapshot, every attempt and every span (not copied from an earlier asset)."""
    store = p.get_store()
    # every rollout the snapshot's stages ran (first batch, later RL steps, evaluation, canary)
    return with_rollout_evidence(store, ctx.head_receipt(store, key), store.query_rollouts(snapshot_key=key))


def first_batch_receipt(p: Pipeline, key: str) -> Receipt:
    """The receipt restricted to the first batch: its rollouts, and the plan's expectation for them."""
    store = p.get_store()
    receipt = ctx.head_receipt(store, key)
    algorithm = receipt.plan.algorithm
    planned = {RolloutKind.train: int(algorithm["tasks_per_step"]) * int(algorithm["group_size"])}
    plan = receipt.plan.model_copy(update={"expected_rollouts": planned})
    restricted = receipt.model_copy(update={"plan": plan})
    return with_rollout_evidence(store, restricted, first_batch(store, key, receipt))


def judge(p: Pipeline, key: str, check: Check) -> CheckOutcome:
    """One of the seven checks on the evidence recorded so far (the same function the verdict uses)."""
    from lightning_dagster.gate import ReceiptLedger
    from lightning_dagster.gate.checks import run_check
    from lightning_dagster.gate.staleness import void_checks

    receipt = first_batch_receipt(p, key) if check in FIRST_BATCH_CHECKS else reverified_receipt(p, key)
    pol, earlier = ctx.policy(p), ReceiptLedger(p.get_store()).evidence_hashes(receipt.receipt_id)
    result = run_check(check, receipt, pol, roles=ctx.approvers(p), earlier=earlier)
    now = ctx.current_fingerprints(p, key)
    void = void_checks(receipt.fingerprints, now, required=pol.staleness.required_fingerprints)
    status, reason = result.status, result.reason
    if status == "pass" and check in void:
        status, reason = "fail", f"void: {'; '.join(void[check])}"
    figures = {"figures": result.figures, "policy": pol.version}
    return CheckOutcome(int(check), result.title, status, reason, figures)


def release_receipt(p: Pipeline, key: str, *, run_id: str = "", keys: list[str] | None = None) -> StageResult:
    """Phases 2 and 3 re-verified, all seven checks under the policy, the verdict; appended immutably.
    `not_run` names each stage a blocking check stopped. With the snapshot `keys` (oldest first), the loop's
    pause or resume this verdict makes is recorded (`triggers.stop_decision`)."""
    from lightning_dagster.gate import ReceiptLedger
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.gate.checks import evaluate
    from lightning_dagster.pipeline.triggers import stop_decision
    from lightning_dagster.registry import receipt_tags

    store, receipt = p.get_store(), reverified_receipt(p, key)
    pol, earlier = ctx.policy(p), ReceiptLedger(store).evidence_hashes(receipt.receipt_id)
    now = ctx.current_fingerprints(p, key)
    evaluation = evaluate(receipt, pol, now, roles=ctx.approvers(p), earlier=earlier)
    final = R.with_gate_record(receipt, evaluation.to_record())
    stored = ctx.append_receipt(store, key, final)
    # The candidate's MLflow version tags name this receipt version and verdict (best effort: the ledger
    # is the record; the next receipt operation writes them again).
    tag_error = receipt_tags.write_after(ctx.registry(p), final.receipt_id)
    loop = stop_decision(p, keys, record=True) if keys is not None else None
    metadata = {
        "verdict": evaluation.verdict,
        "receipt_id": final.receipt_id,
        "receipt_version": stored.version,
        "receipt_hash": stored.content_hash,
        "policy": f"{pol.version} ({pol.hash[:19]})",
        "checks": Markdown(markdown_checks(evaluation)),
        "hold_reasons": evaluation.hold_reasons,
        "not_run": evaluation.not_run,
        "stale_checks": evaluation.stale_checks,
        "orchestrator_run_id": run_id,
        **({"mlflow_tags_not_written": tag_error} if tag_error else {}),
        **({"loop": f"paused: {loop.reason}" if loop.pause else "learning"} if loop else {}),
    }
    return StageResult(metadata, data_version=stored.content_hash)


def approve(p: Pipeline, key: str, approval: Approval) -> StageResult:
    """Record a signed approval (`registry sign`) on the snapshot's receipt once it verifies."""
    from lightning_dagster.release import receipts

    stored = receipts.approve(ctx.registry(p), ctx.receipt_id(key), approval)
    metadata = {
        "receipt_id": stored.receipt.receipt_id,
        "receipt_version": stored.version,
        "actor": approval.actor,
        "role": approval.role,
        "step": approval.step,
        "evidence_hash": approval.evidence_hash,
    }
    return StageResult(metadata)


def promote(p: Pipeline, signed: PromoteRequest) -> StageResult:
    """Promote the receipt's candidate by the actor's signed move (`release.promotion.promote`, with today's
    fingerprints)."""
    from lightning_dagster.release import promotion
    from lightning_dagster.release.errors import PromotionRefused

    store, receipt_id, actor = p.get_store(), signed.receipt_id, signed.actor
    key = ctx.receipt_snapshot(store, receipt_id)
    receipt = None if key is None else ctx.find_receipt(store, key)
    if key is None or receipt is None or receipt.gate is None:
        raise PromotionRefused(
            f"receipt {receipt_id!r} has no gate verdict: materialize release_receipt first"
        )
    registry, policy, now = ctx.registry(p), ctx.policy(p), ctx.current_fingerprints(p, key)
    result = promotion.promote(
        registry, receipt_id, actor, signed=signed, policy=policy, current_fingerprints=now
    )
    return _moved(result, actor=actor, receipt_id=receipt_id)


def rollback(p: Pipeline, request: RollbackRequest) -> StageResult:
    """Move the pointer back by the actor's signed rollback (`release.rollbacks.rollback`)."""
    from lightning_dagster.release import rollbacks

    result = rollbacks.rollback(ctx.registry(p), request)
    return _moved(result, actor=request.actor, role=request.role, reason=request.reason)


def _moved(result: Any, **who: str) -> StageResult:
    """A pointer move: where approved-default went and from where, who moved it, whether MLflow mirrors it."""
    move = {"approved_default": result.move.to_value, "from": result.move.from_value}
    return StageResult(metadata={**move, **who, "mirrored_to_mlflow": result.mirrored})
