"""The receipt builders the Dagster assets call: pure, columnar, and explicit about missing evidence."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from lightning_dagster.gate import receipt as R
from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import run_check
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.types import (
    Attempt,
    AttemptState,
    RetryKind,
    Rollout,
    RolloutKind,
    RolloutStatus,
    Span,
    SpanKind,
)


def _world():
    rollouts = [
        Rollout(rollout_id="r1", kind=RolloutKind.train, status=RolloutStatus.succeeded),
        Rollout(rollout_id="r2", kind=RolloutKind.train, status=RolloutStatus.succeeded),
        Rollout(rollout_id="r3", kind=RolloutKind.train, status=RolloutStatus.failed),
    ]
    attempts = [
        Attempt(attempt_id="a2", rollout_id="r2", sequence_id=1, state=AttemptState.succeeded),
        Attempt(
            attempt_id="a1", rollout_id="r1", sequence_id=1, state=AttemptState.timeout, reason_code="timeout"
        ),
        Attempt(
            attempt_id="a1b",
            rollout_id="r1",
            sequence_id=2,
            state=AttemptState.succeeded,
            retry_kind=RetryKind.infrastructure,
        ),
        Attempt(
            attempt_id="a3",
            rollout_id="r3",
            sequence_id=1,
            state=AttemptState.failed,
            reason_code="exit_nonzero",
        ),
    ]
    spans = [
        Span(rollout_id="r1", attempt_id="a1b", kind=SpanKind.llm),
        Span(rollout_id="r1", attempt_id="a1b", kind=SpanKind.reward),
        Span(rollout_id="r2", attempt_id="a2", kind=SpanKind.llm),
        Span(rollout_id="r2", attempt_id="a2", kind=SpanKind.custom, attributes={"family": "reward"}),
        Span(rollout_id="elsewhere", attempt_id="x", kind=SpanKind.llm),
    ]
    return rollouts, attempts, spans


def test_builders_return_new_receipts_and_leave_the_input_alone(receipt_a):
    before = receipt_a.model_dump()
    approved = R.add_approval(receipt_a, R.Approval(actor="bob", role="ml-lead", step="canary", at=2.0))
    drilled = R.add_rollback_drill(
        receipt_a, receipt_a.rollback_drill.model_copy(update={"routed_back": False})
    )
    assert len(approved.approvals) == 2 and drilled.rollback_drill.routed_back is False
    assert receipt_a.model_dump() == before
    with pytest.raises(ValidationError):  # frozen: evidence is not edited in place
        receipt_a.plan = None


def test_rollout_evidence_is_columnar_and_counts_span_families(receipt_a):
    rollouts, attempts, spans = _world()
    r = R.add_rollout_evidence(R.from_plan(receipt_a.plan), rollouts, attempts, spans)
    ev = r.rollouts
    assert ev.families[:3] == ["llm", "tool", "reward"]  # the plan's families come first, even if unseen
    assert ev.span_counts == [[1, 0, 1], [1, 0, 1], [0, 0, 0]]
    assert ev.attempt_rollout == [0, 0, 1, 2]  # grouped by rollout, then attempt sequence
    assert [k.value for k in ev.attempt_retry_kinds] == ["first", "infrastructure", "first", "first"]
    assert ev.attempt_reasons == ["timeout", None, None, "exit_nonzero"]
    assert ev.total_spans == 4
    coverage = run_check(Check.span_coverage, r, _policy())
    # train rollouts must produce a tool span too: none does
    assert coverage.status == "fail" and coverage.figures["missing_by_family"] == {"tool": 2}
    assert run_check(Check.retry_debt, r, _policy()).figures["infrastructure_retries"] == 1


def test_unreadable_spans_are_unavailable_not_zero(receipt_a):
    rollouts, attempts, _ = _world()
    plan = receipt_a.plan.model_copy(update={"expected_rollouts": None})
    ok = [r.model_copy(update={"status": RolloutStatus.succeeded}) for r in rollouts]
    # each rollout's latest attempt agrees with its status, or the evidence would be inconsistent
    attempts = [
        a.model_copy(update={"state": AttemptState.succeeded}) if a.rollout_id == "r3" else a
        for a in attempts
    ]
    r = R.add_rollout_evidence(R.from_plan(plan), ok, attempts, None)
    assert r.rollouts.span_counts == [None, None, None]
    assert run_check(Check.span_coverage, r, _policy()).status == "unavailable"
    read = R.add_rollout_evidence(R.from_plan(plan), ok, attempts, [("r1", "llm")])
    assert read.rollouts.span_counts[1:] == [[0, 0, 0], [0, 0, 0]]  # read and empty: zero, not unknown


def test_attempts_of_unknown_rollouts_are_invalid(receipt_a):
    rollouts, attempts, spans = _world()
    with pytest.raises(InvalidInput) as err:
        R.add_rollout_evidence(R.from_plan(receipt_a.plan), rollouts[:2], attempts, spans)
    assert err.value.fields == ["attempts"]


def test_family_scores_mark_a_missing_side_unavailable():
    scores = R.family_scores(
        {"a": {"t1": 1.0, "t2": 0.0}, "b": {"t9": 1.0}}, {"a": {"t1": 0.0, "t2": 0.0, "t3": 1.0}}
    )
    assert (scores[0].family, scores[0].n, scores[0].candidate_mean) == ("a", 2, 0.5)
    assert scores[0].distinct_tasks == 2  # the tasks both sides were scored on
    assert scores[0].parent_mean == pytest.approx(1 / 3)
    assert scores[1].parent_mean is None and scores[1].candidate_mean == 1.0


def test_set_fingerprints_rejects_unknown_names(receipt_a):
    assert R.set_fingerprints(receipt_a, evaluator="e2").fingerprints.evaluator == "e2"
    with pytest.raises(InvalidInput) as err:
        R.set_fingerprints(receipt_a, weather="rain")
    assert err.value.fields == ["fingerprints.weather"]


def _policy():
    from lightning_dagster.gate.policy import load_policy

    return load_policy()


def test_builders_type_check_what_they_add(receipt_a):
    with pytest.raises(InvalidInput) as err:
        R.add_candidate(receipt_a, {"resource_id": "res-cand-a"})
    assert "candidate.uri" in err.value.fields


def test_builders_stamp_stage_times_and_keep_them_when_a_stage_reruns_with_equal_evidence(receipt_a):
    unstamped = receipt_a.canary.model_copy(update={"at": None})
    plan_only = R.from_plan(receipt_a.plan)
    stamped = R.add_canary(plan_only, unstamped, at=123.0)
    assert stamped.canary.at == 123.0
    assert R.add_canary(stamped, unstamped, at=999.0).canary.at == 123.0  # same evidence: same time
    changed = unstamped.model_copy(update={"tasks": unstamped.tasks[:1]})
    assert R.add_canary(stamped, changed, at=999.0).canary.at == 999.0
    scored = R.add_evaluation(
        plan_only,
        receipt_a.holdout.model_copy(update={"at": None}),
        receipt_a.protected.model_copy(update={"at": None}),
    )
    assert scored.holdout.at is not None and scored.holdout.at == scored.protected.at  # the clock, once each
