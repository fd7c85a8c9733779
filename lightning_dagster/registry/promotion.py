"""Moving `approved-default`: promotion to a passing receipt's candidate, and rollback to an earlier value,
each authorized by an actor's Ed25519 signature (a default-step approval on the receipt; a signed rollback).

Both are a compare-and-set in the store (`PointerConflict` if another move came first), mirrored to MLflow
afterwards (alias, `approved_default` flag, receipt tags); a failed mirror leaves the move standing and is repaired by the next operation."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lightning_dagster.registry import pointers, receipt_tags, receipts, rollbacks
from lightning_dagster.registry.errors import (
    CheckpointFilesMismatch,
    NotAuthorized,
    PointerConflict,
    PromotionRefused,
    RollbackRefused,
    WeightsMismatch,
)

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry
    from lightning_dagster.registry.rollbacks import RollbackRequest

DEFAULT_APPROVER = "default-approver"


@dataclass(frozen=True)
class PromotionResult:
    move: Any  # store.PointerMove
    mirrored: bool
    mirror_error: str | None = None


def _require_default_approval(reg: Registry, stored: receipts.StoredReceipt, actor: str) -> None:
    """Every approval on the receipt verifies against the deployment's roles, and one of them is `actor`'s
    signed approval of the default step on exactly this evidence, in a role the receipt names for it."""
    receipts.verify_approvals(reg.store, stored.receipt, reg.roles())
    roles = stored.receipt.plan.approvers.default
    if not any(a.actor == actor and a.step == "default" for a in stored.receipt.approvals):
        raise NotAuthorized(
            actor,
            " or ".join(roles) or "<none named>",
            f"receipt {stored.receipt.receipt_id} holds no signed default-step approval by this actor",
        )


def promote(
    reg: Registry,
    receipt: Any,
    actor: str,
    *,
    policy: Any = None,
    current_fingerprints: Mapping[str, str | None] | None = None,
) -> PromotionResult:
    """Move `approved-default` from the receipt's parent to its candidate, or refuse with the reason.

    Requires: a receipt the pipeline wrote (`receipts.require_pipeline_written`) and judged, under exactly
    the policy of its gate record; the gate, run now on the ledger's head version under `policy` (default: the packaged one) with
    `current_fingerprints`, says promote and voids no check; every approval on it verifies against the
    deployment's roles and `actor` signed the default step on this evidence; the candidate is registered with the receipt's weights; and `approved-default` is exactly
    the receipt's parent (version and weights)."""
    from lightning_dagster.gate import PROMOTE, Policy, evaluate, load_policy

    pointers.reconcile(reg)
    stored = receipts.load(reg.store, receipt)
    facts = receipts.facts(stored.receipt, reg.model_name)
    # Only the pipeline's receipts: their evidence is what its stages recorded, and their gate record names
    # the policy the deployment judged them under (a hand-brought receipt names whichever policy it likes).
    receipts.require_pipeline_written(reg.store, stored.receipt)
    policy = policy if isinstance(policy, Policy) else load_policy(policy)
    judged = stored.receipt.gate
    if judged is not None and judged.policy_hash != policy.hash:
        # The policy is the release's contract: a caller cannot re-judge a receipt under thresholds of its own.
        raise PromotionRefused(
            f"receipt {facts.receipt_id} was judged under policy {judged.policy_version} ({judged.policy_hash}); "
            f"promotion under {policy.version} ({policy.hash}) is refused"
        )
    evaluation = evaluate(stored.receipt, policy, current_fingerprints, roles=reg.roles().actors)
    if evaluation.verdict != PROMOTE or evaluation.stale_checks:
        raise PromotionRefused(
            f"receipt {facts.receipt_id} (version {stored.version}) is {evaluation.verdict} under "
            f"{policy.version}: " + "; ".join(evaluation.hold_reasons)
        )
    _require_default_approval(reg, stored, actor)
    candidate = reg.model_version(facts.candidate_version)
    if facts.candidate_weights_hash and not receipts.same_hash(
        facts.candidate_weights_hash, candidate.weights_hash
    ):
        raise PromotionRefused(
            f"candidate version {candidate.version} has weights {candidate.weights_hash}, "
            f"the receipt names {facts.candidate_weights_hash}"
        )
    if facts.candidate_files_hash and facts.candidate_files_hash != candidate.files_hash:
        raise PromotionRefused(
            f"candidate version {candidate.version} has checkpoint files {candidate.files_hash or '(none recorded)'}, "
            f"the receipt names {facts.candidate_files_hash}"
        )
    # The bytes MLflow hands out must be the registered weights: its artifact store lies in the learner's
    # write surface, and a pointer moved onto other bytes names a model no server can load (nor roll back
    # from once it is a parent). Rollback checks its target the same way before it moves.
    try:
        reg.fetch(candidate, fresh=True)
    except CheckpointFilesMismatch as exc:
        raise PromotionRefused(
            f"candidate version {candidate.version}'s artifact is not the checkpoint it was registered "
            f"with: {exc}"
        ) from exc
    except WeightsMismatch as exc:
        raise PromotionRefused(
            f"candidate version {candidate.version}'s artifact is not the weights it was registered with: {exc}"
        ) from exc
    history = reg.history()
    # The exact parent: the pointer must hold the receipt's parent version, and the weights recorded when it
    # was approved must be the receipt's parent weights (version numbers can be reused).
    last = (history or [None])[-1]
    current = last.to_value if last else None
    approved_hash = pointers.approved_hash(last)
    if facts.parent_version is not None and current != facts.parent_version:
        raise PointerConflict(reg.pointer_name(), facts.parent_version, current)
    if facts.parent_weights_hash and not receipts.same_hash(approved_hash, facts.parent_weights_hash):
        raise PointerConflict(
            reg.pointer_name(), f"weights {facts.parent_weights_hash}", f"{current} ({approved_hash})"
        )
    # A receipt moves the pointer once. After a rollback the pointer holds the receipt's parent again, so the
    # same receipt and approval would pass every check above and undo the rollback with a decision made
    # before it; a rolled-back candidate goes forward again only through a new receipt and approval.
    used = [m for m in history if m.receipt_id == facts.receipt_id]
    if used:
        raise PromotionRefused(
            f"receipt {facts.receipt_id} already moved {reg.pointer_name()} (move {used[0].seq}, "
            f"{used[0].from_value} -> {used[0].to_value}, {pointers.iso(used[0].moved_at)}); a receipt "
            "promotes once: a candidate rolled back since is promoted again only through a new receipt"
        )
    move = pointers.move(
        reg,
        expected=current,
        expected_seq=last.seq if last else 0,  # the state every check above judged, not only its value
        to=candidate.version,
        weights_hash=candidate.weights_hash,
        files_hash=candidate.files_hash,
        actor=actor,
        note="promotion",
        receipt_id=facts.receipt_id,
        receipt_hash=stored.content_hash,
        receipt_version=stored.version,
        policy=f"{policy.version} {policy.hash}",
    )
    # The version's receipt tags then name the very receipt version and hash the move records.
    error = pointers.mirror_after_move(reg) or receipt_tags.write_after(reg, stored)
    return PromotionResult(move=move, mirrored=error is None, mirror_error=error)


def rollback_roles(reg: Registry, head: Any) -> list[str]:
    """Who may move the pointer back by default: `default-approver`, and the roles the receipt of the move
    being undone named for its default step (a deployment's `default_approver_roles`, recorded in its plan):
    whoever may move the default forward may also take that move back."""
    roles = [DEFAULT_APPROVER]
    if head is not None and head.receipt_id:
        try:
            stored = receipts.load(reg.store, head.receipt_id)
        except Exception:  # noqa: BLE001 - an unreadable receipt widens nothing
            return roles
        roles += [r for r in stored.receipt.plan.approvers.default if r not in roles]
    return roles


def rollback(
    reg: Registry,
    request: RollbackRequest,
    *,
    allowed_roles: Collection[str] | None = None,
) -> PromotionResult:
    """Move `approved-default` back to a version it held before, after proving that version serves.

    `request` is an actor's signed rollback (`rollbacks.sign_rollback`): its role must be one of the
    `allowed_roles` that may move the pointer and held by the actor in the pinned roles (holding some other
    role, `ml-lead` or `roles-admin`, and naming it authorizes nothing), and its signature must verify with
    that actor's pinned key over exactly this decision (this pointer, its newest move, the target, role,
    reason and time); otherwise `RollbackRefused` and nothing moves. The target must appear in the pointer
    history as an earlier approved value (never "the newest version"); its bytes are verified, it is loaded
    and answers one chat completion through a gateway, and only then does the pointer move, with a history
    entry naming the verified actor, role, reason and signature."""
    from lightning_dagster.registry.approved import serve_once

    pointers.reconcile(reg)
    name = reg.pointer_name()
    history = reg.history()
    head = history[-1] if history else None
    if allowed_roles is None:
        allowed_roles = rollback_roles(reg, head)

    def refuse_unless_authorized(head: Any) -> None:
        problem = rollbacks.rollback_problem(request, name, head, reg.roles().actors, allowed_roles)
        if problem is not None:
            raise RollbackRefused(request.actor, request.role, problem)

    refuse_unless_authorized(head)
    to_version = request.target_version
    current = head.to_value if head else None
    if to_version == current:
        raise PromotionRefused(f"version {to_version} is already approved-default")
    if to_version not in {m.to_value for m in history[:-1]}:
        raise PromotionRefused(f"version {to_version} was never approved-default; rollback only goes back")
    target = reg.model_version(to_version)
    approved = {pointers.approved_hash(m) for m in history if m.to_value == to_version}
    if target.weights_hash not in approved:
        raise WeightsMismatch(to_version, ",".join(sorted(h for h in approved if h)), target.weights_hash)
    files = {pointers.approved_files_hash(m) for m in history if m.to_value == to_version} - {None}
    if files and target.files_hash not in files:
        raise CheckpointFilesMismatch(to_version, ",".join(sorted(files)), target.files_hash or "(none)")
    serve_once(reg.fetch(target))
    # The probe takes seconds: a move made meanwhile (even one back to this value) voids the signature.
    latest = reg.store.pointer_history(name, last=1)
    refuse_unless_authorized(latest[-1] if latest else None)
    move = pointers.move(
        reg,
        expected=current,
        expected_seq=head.seq,  # the move the signature names: any move since refuses this one
        to=to_version,
        weights_hash=target.weights_hash,
        files_hash=target.files_hash,
        actor=request.actor,
        note="rollback",
        role=request.role,
        reason=request.reason,
        signed_at=request.at,
        from_seq=request.from_seq,
        signature=request.signature,
    )
    error = pointers.mirror_after_move(reg)
    return PromotionResult(move=move, mirrored=error is None, mirror_error=error)
