"""Pure builders of the update receipt: each returns a new, validated receipt. Phase-3 builders stamp when a
stage finished (`at`) unless the evidence carries it: the gate checks plan, training, evaluation, canary and
approval happened in that order.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from statistics import fmean
from typing import Any

from pydantic import BaseModel, ValidationError

from lightning_dagster.gate.errors import InvalidInput, from_validation_error
from lightning_dagster.gate.receipt_models import (
    Approval,
    CanaryReport,
    CandidateArtifact,
    FamilyScore,
    Fingerprints,
    GateRecord,
    HoldoutComparison,
    Plan,
    ProtectedResults,
    Receipt,
    RollbackDrill,
    RolloutEvidence,
)
from lightning_dagster.types import Attempt, Rollout, Span, span_family


def from_plan(
    plan: Plan, *, receipt_id: str | None = None, fingerprints: Fingerprints | None = None
) -> Receipt:
    """Phase 1: a receipt holding only the frozen plan. The id defaults to the candidate id."""
    return Receipt(
        receipt_id=receipt_id or plan.candidate_id, plan=plan, fingerprints=fingerprints or Fingerprints()
    )


def rollout_evidence(
    rollouts: Sequence[Rollout],
    attempts: Sequence[Attempt],
    spans: Iterable[Span | tuple[str, str]] | None,
    *,
    families: Sequence[str] = (),
) -> RolloutEvidence:
    """Build the columnar phase-2 evidence; `spans` None: unreadable (every row unavailable)."""
    index = {r.rollout_id: i for i, r in enumerate(rollouts)}
    columns: dict[str, int] = {f: j for j, f in enumerate(families)}
    counts: list[list[int]] = [[0] * len(columns) for _ in rollouts]
    if spans is not None:
        # Count (rollout, family) pairs first (Counter runs in C), then place the distinct pairs.
        pairs = Counter(
            s if isinstance(s, tuple) else (s.rollout_id, span_family(s.kind.value, s.name, s.attributes))
            for s in spans
        )
        for (rid, fam), n in pairs.items():
            i = index.get(rid)
            if i is None:
                continue  # a span of a rollout outside this receipt
            j = columns.get(fam)
            if j is None:
                j = columns[fam] = len(columns)
                for row in counts:
                    row.append(0)
            counts[i][j] += n
    rows: list[list[int] | None] = [None] * len(rollouts) if spans is None else list(counts)
    ordered = sorted(attempts, key=lambda a: (index.get(a.rollout_id, -1), a.sequence_id))
    unknown = [a.attempt_id for a in ordered if a.rollout_id not in index]
    if unknown:
        raise InvalidInput("rollout evidence", [("attempts", f"attempts of unknown rollouts: {unknown[:5]}")])
    return RolloutEvidence(
        rollout_ids=[r.rollout_id for r in rollouts],
        kinds=[r.kind for r in rollouts],
        statuses=[r.status for r in rollouts],
        families=list(columns),
        span_counts=rows,
        attempt_rollout=[index[a.rollout_id] for a in ordered],
        attempt_endings=[a.state for a in ordered],
        attempt_retry_kinds=[a.retry_kind for a in ordered],
        attempt_reasons=[a.reason_code for a in ordered],
    )


def _with(receipt: Receipt, **update: Any) -> Receipt:
    """`receipt` with `update`, validated (instances are taken as they are: evidence costs nothing)."""
    try:
        return Receipt.model_validate({**dict(receipt), **update})
    except ValidationError as err:
        raise from_validation_error("receipt", err) from None


def add_rollout_evidence(
    receipt: Receipt,
    rollouts: Sequence[Rollout],
    attempts: Sequence[Attempt],
    spans: Iterable[Span | tuple[str, str]] | None,
) -> Receipt:
    """Phase 2: rollouts with every attempt and span counts per family (the plan's families first)."""
    expected = [f for fams in receipt.plan.expected_span_families.values() for f in fams]
    families = list(dict.fromkeys(expected))
    evidence = rollout_evidence(rollouts, attempts, spans, families=families)
    return _with(receipt, rollouts=evidence)


def _stamped(model: Any, field: str, at: float | None, recorded: BaseModel | None) -> Any:
    """`model` with its time `field` set (to `at`, else now) unless it records one; evidence equal to what the
    receipt holds keeps its time, so re-running a stage amends nothing."""
    if not isinstance(model, BaseModel) or getattr(model, field) is not None:
        return model
    if recorded is not None and recorded.model_copy(update={field: None}) == model:
        return recorded
    return model.model_copy(update={field: time.time() if at is None else at})


def add_candidate(receipt: Receipt, candidate: CandidateArtifact, *, at: float | None = None) -> Receipt:
    return _with(receipt, candidate=_stamped(candidate, "created_at", at, receipt.candidate))


def family_scores(
    candidate: Mapping[str, Mapping[str, float]], parent: Mapping[str, Mapping[str, float]]
) -> list[FamilyScore]:
    """Per-family means of family -> task id -> reward; `n`, `distinct_tasks`: the tasks both sides had."""
    scores = []
    for family in sorted(set(candidate) | set(parent)):
        c, p = candidate.get(family) or {}, parent.get(family) or {}
        n = len(c.keys() & p.keys()) if c and p else max(len(c), len(p))
        scores.append(
            FamilyScore(
                family=family,
                n=n,
                distinct_tasks=n,
                candidate_mean=fmean(c.values()) if c else None,
                parent_mean=fmean(p.values()) if p else None,
            )
        )
    return scores


def add_evaluation(
    receipt: Receipt, holdout: HoldoutComparison, protected: ProtectedResults, *, at: float | None = None
) -> Receipt:
    """Phase 3a: held-out comparison and protected cases, both against the exact parent."""
    at = time.time() if at is None else at  # one evaluation stage: one time for both
    return _with(
        receipt,
        holdout=_stamped(holdout, "at", at, receipt.holdout),
        protected=_stamped(protected, "at", at, receipt.protected),
    )


def add_canary(receipt: Receipt, canary: CanaryReport, *, at: float | None = None) -> Receipt:
    return _with(receipt, canary=_stamped(canary, "at", at, receipt.canary))


def add_rollback_drill(receipt: Receipt, drill: RollbackDrill) -> Receipt:
    return _with(receipt, rollback_drill=drill)


def add_approval(receipt: Receipt, approval: Approval) -> Receipt:
    return _with(receipt, approvals=[*receipt.approvals, approval])


def set_fingerprints(receipt: Receipt, **values: str | None) -> Receipt:
    """Fill fingerprints (`evaluator=...`, `parent=...`); unknown names are an error."""
    merged = {**receipt.fingerprints.model_dump(), **values}
    try:
        return _with(receipt, fingerprints=Fingerprints.model_validate(merged))
    except ValidationError as err:
        raise from_validation_error("fingerprints", err, "fingerprints") from None


def with_gate_record(receipt: Receipt, record: GateRecord) -> Receipt:
    return _with(receipt, gate=record)
