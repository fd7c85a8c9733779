"""Moving `approved-default` forward to a passing receipt's candidate, by an actor's signed default-step
approval, once the gate passes it again now: a compare-and-set in the store, mirrored to MLflow afterwards
(a failed mirror leaves the move standing; the next operation repairs it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from lightning_dagster.gate import PROMOTE, ReceiptLedger, evaluate
from lightning_dagster.gate.policy import Policy, load_policy
from lightning_dagster.gate.receipt import Receipt
from lightning_dagster.registry import pointers, receipt_tags
from lightning_dagster.registry.checkpoints import same_hash
from lightning_dagster.registry.errors import CheckpointFilesMismatch, PointerConflict, WeightsMismatch
from lightning_dagster.registry.receipt_tags import StoredReceipt
from lightning_dagster.release import chain, receipts
from lightning_dagster.release.errors import NotAuthorized, PromotionRefused
from lightning_dagster.release.roles import registry_roles
from lightning_dagster.release.signing import Name, load_private_key
from lightning_dagster.store.records import PointerMove

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry

DEFAULT_APPROVER = "default-approver"


@dataclass(frozen=True)
class PromotionResult:
    move: Any  # store.PointerMove
    mirrored: bool
    mirror_error: str | None = None


class PromoteRequest(BaseModel):
    """A signed promotion (`registry sign-promote`, the `promote` job's config), binding the move
    (`chain.signed_fields`): it promotes once, from the pointer state and receipt version it was signed on."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    receipt_id: Name
    actor: Name
    role: Name
    seq: int = Field(ge=1)
    at: float = Field(gt=0)
    signature: str = ""


@dataclass(frozen=True)
class ReceiptFacts:
    receipt_id: str
    candidate_version: str
    candidate_weights_hash: str | None
    candidate_files_hash: str | None  # None: a receipt written before checkpoint files were hashed
    parent_version: str | None  # None: the parent is named by weights hash only
    parent_weights_hash: str | None


def _registered(value: str | None, field: str, receipt: Receipt, model_name: str) -> str | None:
    """A receipt's version field, checked to be a version number (never recovered from a URI)."""
    if value is not None and not value.isdigit():
        raise PromotionRefused(
            f"receipt {receipt.receipt_id}: {field} {value!r} is not a version number of {model_name}"
        )
    return value


def facts(receipt: Receipt, model_name: str) -> ReceiptFacts:
    """The identities promotion checks; a receipt that does not name them is refused, naming the field."""
    plan = receipt.plan
    parent = _registered(plan.parent.model_version, "plan.parent.model_version", receipt, model_name)
    if parent is None and not plan.parent.weights_hash:
        raise PromotionRefused(
            f"receipt {receipt.receipt_id}: plan.parent names neither a version of {model_name} nor weights"
        )
    cand = receipt.candidate
    if cand is None:
        raise PromotionRefused(f"receipt {receipt.receipt_id}: no candidate recorded")
    candidate = _registered(cand.model_version, "candidate.model_version", receipt, model_name)
    if candidate is None:
        raise PromotionRefused(f"receipt {receipt.receipt_id}: candidate.model_version is not recorded")
    return ReceiptFacts(
        receipt_id=receipt.receipt_id,
        candidate_version=candidate,
        candidate_weights_hash=cand.weights_hash,
        candidate_files_hash=cand.files_hash,
        parent_version=parent,
        parent_weights_hash=plan.parent.weights_hash,
    )


def require_pipeline_written(store: Any, receipt: Receipt) -> str:
    """The receipt's snapshot key; `PromotionRefused` unless the pipeline wrote it and its gate judged it."""
    key = receipts.planned_snapshot(store, receipt.receipt_id)
    if key is None:
        raise PromotionRefused(
            f"receipt {receipt.receipt_id} was not written by the pipeline (no snapshot planned it): "
            "a receipt brought in by hand is never promoted, its evidence is not what the store recorded"
        )
    if receipt.gate is None:
        raise PromotionRefused(
            f"receipt {receipt.receipt_id} has no gate verdict: materialize release_receipt for snapshot {key} first"
        )
    return key


def _require_default_approval(reg: Registry, stored: StoredReceipt, actor: str) -> None:
    """Every approval verifies against the deployment's roles, one of them `actor`'s of the default step."""
    receipts.verify_approvals(reg.store, stored.receipt, registry_roles(reg))
    roles = stored.receipt.plan.approvers.default
    if not any(a.actor == actor and a.step == "default" for a in stored.receipt.approvals):
        raise NotAuthorized(
            actor,
            " or ".join(roles) or "<none named>",
            f"receipt {stored.receipt.receipt_id} holds no signed default-step approval by {actor!r} (sign "
            f"one as {' or '.join(roles) or '<no role the receipt names>'}: `registry promote --key`)",
        )


def sign_promotion(
    reg: Registry, receipt: Any, *, actor: str, key: Path | str, at: float | None = None, head: Any = ...
) -> PromoteRequest:
    """`actor`'s signed promotion in the role of their default-step approval; it moves nothing."""
    head = reg.verified().require().head if head is ... else head  # `promote --key`: the head it judged
    stored = receipts.load(reg.store, receipt)
    named = facts(stored.receipt, reg.model_name)
    role = next((a.role for a in stored.receipt.approvals if a.actor == actor and a.step == "default"), None)
    if role is None:
        raise NotAuthorized(
            actor, DEFAULT_APPROVER, f"receipt {named.receipt_id} holds no default-step approval by {actor!r}"
        )
    candidate = reg.model_version(named.candidate_version)
    request = PromoteRequest(
        receipt_id=named.receipt_id, actor=actor, role=role, seq=(head.seq if head else 0) + 1,
        at=time.time() if at is None else at,
    )  # fmt: skip
    note = _note(candidate, request, stored.content_hash)
    signature = chain.sign_move(load_private_key(key), reg.pointer_name(), request.seq, head and head.to_value,
                                candidate.version, actor, named.receipt_id, note)  # fmt: skip
    return request.model_copy(update={"signature": signature})


def _note(candidate: Any, request: PromoteRequest, receipt_hash: str) -> dict[str, Any]:
    return chain.move_note(candidate.weights_hash, candidate.files_hash, kind=chain.PROMOTION,
                           role=request.role, at=request.at, receipt_hash=receipt_hash)  # fmt: skip


def promote(
    reg: Registry,
    receipt: Any,
    actor: str,
    *,
    signed: PromoteRequest | None = None,
    key: Path | str | None = None,
    policy: Any = None,
    current_fingerprints: Mapping[str, str | None] | None = None,
) -> PromotionResult:
    """Move `approved-default` from the receipt's parent to its candidate, or refuse with the reason: the
    pipeline wrote the receipt and judged it under exactly `policy`; the gate, run now with
    `current_fingerprints`, promotes and voids nothing; `actor` signed the default step on this evidence;
    the candidate holds the receipt's weights; the verified head is exactly the receipt's parent; and
    `signed` (or a promotion signed here with `key`) is `actor`'s signature of this move."""
    verified = pointers.reconcile(reg).chain.require()
    stored = receipts.load(reg.store, receipt)
    named = facts(stored.receipt, reg.model_name)
    # Only the pipeline's receipts: their evidence is what its stages recorded, and their gate record names
    # the policy the deployment judged them under (a hand-brought receipt names whichever policy it likes).
    require_pipeline_written(reg.store, stored.receipt)
    policy = policy if isinstance(policy, Policy) else load_policy(policy)
    judged = stored.receipt.gate
    if judged is not None and judged.policy_hash != policy.hash:
        # The policy is the release's contract: a caller cannot re-judge a receipt under thresholds of its own.
        raise PromotionRefused(
            f"receipt {named.receipt_id} was judged under policy {judged.policy_version} ({judged.policy_hash}); "
            f"promotion under {policy.version} ({policy.hash}) is refused"
        )
    roles, earlier = registry_roles(reg).actors, ReceiptLedger(reg.store).evidence_hashes(named.receipt_id)
    evaluation = evaluate(stored.receipt, policy, current_fingerprints, roles=roles, earlier=earlier)
    if evaluation.verdict != PROMOTE or evaluation.stale_checks:
        raise PromotionRefused(
            f"receipt {named.receipt_id} (version {stored.version}) is {evaluation.verdict} under "
            f"{policy.version}: " + "; ".join(evaluation.hold_reasons)
        )
    _require_default_approval(reg, stored, actor)
    candidate = reg.model_version(named.candidate_version)
    if named.candidate_weights_hash and not same_hash(named.candidate_weights_hash, candidate.weights_hash):
        raise PromotionRefused(
            f"candidate version {candidate.version} has weights {candidate.weights_hash}, "
            f"the receipt names {named.candidate_weights_hash}"
        )
    if named.candidate_files_hash and named.candidate_files_hash != candidate.files_hash:
        raise PromotionRefused(
            f"candidate version {candidate.version} has checkpoint files {candidate.files_hash or '(none recorded)'}, "
            f"the receipt names {named.candidate_files_hash}"
        )
    # The bytes MLflow hands out must be the registered ones: its artifact store lies in the learner's write
    # surface, and a pointer moved onto other bytes names a model no server can load (nor roll back from).
    try:
        reg.fetch(candidate, fresh=True)
    except WeightsMismatch as exc:
        what = "checkpoint" if isinstance(exc, CheckpointFilesMismatch) else "weights"
        raise PromotionRefused(
            f"candidate version {candidate.version}'s artifact is not the {what} it was registered with: "
            f"{exc}"
        ) from exc
    # The exact parent: version, and the weights recorded at its approval (version numbers can be reused).
    last, current = verified.head, verified.value
    approved_hash = pointers.approved_hash(last)
    if named.parent_version is not None and current != named.parent_version:
        raise PointerConflict(reg.pointer_name(), named.parent_version, current)
    if named.parent_weights_hash and not same_hash(approved_hash, named.parent_weights_hash):
        raise PointerConflict(
            reg.pointer_name(), f"weights {named.parent_weights_hash}", f"{current} ({approved_hash})"
        )
    # A receipt moves the pointer once: after a rollback to its parent, the same receipt and approval would
    # pass every check above and undo the rollback with a decision made before it.
    used = [m for m in verified.moves if m.receipt_id == named.receipt_id]
    if used:
        raise PromotionRefused(
            f"receipt {named.receipt_id} already moved {reg.pointer_name()} (move {used[0].seq}, "
            f"{used[0].from_value} -> {used[0].to_value}, {pointers.iso(used[0].moved_at)}); a receipt "
            "promotes once: a candidate rolled back since is promoted again only through a new receipt"
        )
    if signed is None and key is not None:
        signed = sign_promotion(reg, named.receipt_id, actor=actor, key=key, head=last)
    if signed is None or (signed.receipt_id, signed.actor) != (named.receipt_id, actor):
        raise PromotionRefused(
            f"the move is not signed: {actor} signs it with `lightning-dagster registry sign-promote "
            f"{named.receipt_id} --actor {actor} --key KEY` (the `promote` job's run config) or `promote --key`"
        )
    note = {**_note(candidate, signed, stored.content_hash), "signature": signed.signature}
    pending = PointerMove(
        name=reg.pointer_name(), from_value=current, to_value=candidate.version, actor=actor,
        receipt_id=named.receipt_id, note=json.dumps(note), moved_at=time.time(), seq=signed.seq,
    )  # fmt: skip
    if problem := verified.check_next(reg.store, pending, reg.gate):
        raise PromotionRefused(
            f"the signed promotion does not verify as {reg.pointer_name()}'s next move "
            f"(move {(last.seq if last else 0) + 1} from {current}): {problem}; sign it again"
        )
    move = pointers.move(
        reg,
        expected=current,
        expected_seq=last.seq if last else 0,  # the state every check above judged, not only its value
        to=candidate.version,
        actor=actor,
        signed=note,
        note="promotion",
        receipt_id=named.receipt_id,
        receipt_version=stored.version,
        policy=f"{policy.version} {policy.hash}",
    )
    # The version's receipt tags then name the very receipt version and hash the move records.
    error = pointers.mirror_after_move(reg) or receipt_tags.write_after(reg, stored)
    return PromotionResult(move=move, mirrored=error is None, mirror_error=error)
