"""What an approval signs (`signing.APPROVAL`: receipt id, evidence hash, step, actor, role, time) and how it
is verified. The evidence hash leaves out the approvals and the gate's record, so later approvals do not
change what earlier ones signed, while any added or edited evidence does. Pure: imports nothing of the gate.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from lightning_dagster.canonical import content_hash
from lightning_dagster.release.signing import APPROVAL, ActorKey, signer, verify

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt_models import Approval, Receipt


def evidence_hash(receipt: Receipt) -> str:
    return content_hash(receipt.model_dump(mode="json", exclude={"gate", "approvals"}))


def approval_fields(receipt_id: str, approval: Approval) -> dict[str, Any]:
    return {"receipt_id": receipt_id, **approval.model_dump(exclude={"signature"})}


def approval_problem(
    receipt: Receipt, approval: Approval, actors: Mapping[str, ActorKey], accepted: Collection[str]
) -> str | None:
    """Why `approval` proves nothing for `receipt` (None: valid); `accepted`: evidence hashes it may sign."""
    who = f"approval by {approval.actor} as {approval.role} ({approval.step})"
    allowed = receipt.plan.approvers.default if approval.step == "default" else receipt.plan.approvers.canary
    if approval.role not in allowed:
        return f"{who}: the plan does not let role {approval.role} approve the {approval.step} step"
    entry = signer(who, actors, approval.actor, approval.role, approval.signature)
    if isinstance(entry, str):
        return entry
    if not approval.evidence_hash:
        return f"{who}: not signed"
    if approval.evidence_hash not in accepted:
        return f"{who}: signs evidence {approval.evidence_hash}, not this receipt's"
    if not verify(
        entry.public_key, APPROVAL, approval_fields(receipt.receipt_id, approval), approval.signature
    ):
        return f"{who}: signature does not verify with {approval.actor}'s key"
    return None


def approval_problems(
    receipt: Receipt, actors: Mapping[str, ActorKey], earlier: Collection[str] = ()
) -> list[str]:
    """Every approval that does not verify (a canary one may sign an `earlier` version) or repeats one."""
    current = evidence_hash(receipt)
    problems = []
    for k, approval in enumerate(receipt.approvals):
        accepted = {current} if approval.step == "default" else {current, *earlier}
        if approval in receipt.approvals[:k]:
            problems.append(
                f"approvals.{k} by {approval.actor} ({approval.step}) repeats an earlier approval"
            )
        elif (problem := approval_problem(receipt, approval, actors, accepted)) is not None:
            problems.append(problem)
    return problems
