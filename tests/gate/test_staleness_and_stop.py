"""Staleness voids exactly the mapped checks; stop conditions pause continual learning with reasons."""

from __future__ import annotations

import pytest

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, evaluate
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.receipt import Fingerprints, parse_receipt
from lightning_dagster.gate.staleness import VOIDS, void_checks
from lightning_dagster.gate.stop import stop_decision
from tests.gate.conftest import raw, set_path, with_threshold


@pytest.mark.parametrize("name, voided", sorted(VOIDS.items()))
def test_a_changed_fingerprint_voids_its_checks_and_holds_a_passing_receipt(receipt_a, policy, name, voided):
    ev = evaluate(receipt_a, policy, {name: "sha256:something-new"})
    assert ev.verdict == HOLD
    assert ev.stale_checks == sorted(voided)
    assert all(c.status == "pass" for c in ev.checks)  # the evidence itself was fine...
    assert {c.id for c in ev.checks if c.void} == set(voided)  # ...but no longer covers the present
    assert all(name in reason for reason in ev.hold_reasons)


def test_unchanged_fingerprints_keep_the_verdict(receipt_a, policy):
    ev = evaluate(receipt_a, policy, receipt_a.fingerprints.model_dump())
    assert ev.verdict == "PROMOTE TO BOUNDED CANARY" and ev.stale_checks == []


def test_the_design_cases_of_staleness():
    rec = Fingerprints(
        evaluator="e1", parent="p1", serving_model="s1", permissions="x", destinations="d", retry_policy="r"
    )
    assert {4, 5} <= set(void_checks(rec, {"evaluator": "e2"}))
    assert set(void_checks(rec, {"parent": "p2"})) == {1, 4, 7}
    for name in ("permissions", "destinations", "serving_model", "retry_policy"):
        assert 6 in void_checks(rec, {name: "new"}), name  # an earlier canary does not cover it
    assert void_checks(rec, {"tool_contract": "t"})  # never recorded, now given: cannot show freshness
    assert void_checks(rec, None) == {}
    assert set(void_checks(rec, None, required=["task_distribution"])) == {4, 5}


def test_unknown_current_fingerprint_is_invalid_input():
    with pytest.raises(InvalidInput) as err:
        void_checks(Fingerprints(), {"weather": "rain"})
    assert err.value.fields == ["weather"]


def test_healthy_evidence_continues(receipt_a, policy):
    decision = stop_decision(receipt_a, policy, previous=receipt_a)
    assert not decision.pause and decision.reasons == [] and decision.unavailable == []


@pytest.mark.parametrize(
    "name, fragment",
    [
        ("b", "span coverage dropped"),
        ("b", "retry debt over its limit"),
        ("c", "protected set regressed"),
        ("d", "parent res-parent-7f3a unavailable"),
        ("d", "canary could not verify an external effect"),
    ],
)
def test_each_stop_condition_pauses_with_its_reason(policy, name, fragment):
    decision = stop_decision(parse_receipt(raw(name)), policy)
    assert decision.pause
    assert any(fragment in r for r in decision.reasons), decision.reasons


def test_coverage_drop_against_the_previous_receipt_pauses(receipt_a, policy):
    lenient = with_threshold(policy, Check.span_coverage, min_complete_share=0.5)
    # rollout 0 failed: its status and its latest attempt (a sample retry, attempt 1) say so
    failed = set_path(
        set_path(raw("a"), "rollouts.statuses.0", "failed"), "rollouts.attempt_endings.1", "failed"
    )
    latest = parse_receipt(failed)
    assert evaluate(latest, lenient).checks[1].status == "pass"  # above the gate's floor...
    decision = stop_decision(latest, lenient, previous=receipt_a)
    assert decision.pause and "dropped from 1.0 to 0.991667" in decision.reasons[0]  # ...but falling


def test_missing_evidence_is_listed_not_a_reason_to_pause(policy):
    data = raw("a")
    for section in ("rollouts", "protected", "canary"):
        data[section] = None
    decision = stop_decision(parse_receipt(data), policy)
    assert not decision.pause
    assert len(decision.unavailable) == 4


def test_unknown_parent_availability_pauses(policy):
    decision = stop_decision(parse_receipt(set_path(raw("a"), "plan.parent.loads", None)), policy)
    assert decision.pause and "loads=None" in decision.reasons[0]
