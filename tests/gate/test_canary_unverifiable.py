"""A canary of a project whose harness has no `verify` hook: check 6's effect check is unavailable for that
reason (never a pass, never judged on another agent's effects), and continual learning is not paused for it."""

from __future__ import annotations

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import run_check
from lightning_dagster.gate.receipt import parse_receipt
from lightning_dagster.gate.stop import stop_decision
from lightning_dagster.pipeline.context import UNVERIFIABLE
from tests.gate.conftest import raw


def unverifiable(receipt):
    tasks = [
        t.model_copy(
            update={"verified": False, "destination": None, "harmful_effect": None, "uncertainty": 1.0}
        )
        for t in receipt.canary.tasks
    ]
    canary = receipt.canary.model_copy(update={"tasks": tasks, "unverifiable": UNVERIFIABLE})
    return receipt.model_copy(update={"canary": canary})


def test_without_verify_the_effect_check_is_unavailable_with_its_reason(policy):
    receipt = parse_receipt(raw("a"))
    assert run_check(Check.canary_verified, receipt, policy).status == "pass"
    result = run_check(Check.canary_verified, unverifiable(receipt), policy)
    assert result.status == "unavailable"
    assert (
        result.reason == f"effect check unavailable: {UNVERIFIABLE}" and "no `verify` hook" in result.reason
    )
    assert result.figures["unverifiable"] == UNVERIFIABLE and result.figures["weaker_evidence"] == []


def test_a_limit_broken_still_fails_and_the_reason_stays_named(policy):
    receipt = unverifiable(parse_receipt(raw("a")))
    over = receipt.canary.model_copy(update={"usage": receipt.canary.usage.model_copy(update={"cost": 9.0})})
    result = run_check(Check.canary_verified, receipt.model_copy(update={"canary": over}), policy)
    assert result.status == "fail" and "cost" in result.reason and UNVERIFIABLE in result.reason


def test_the_reason_round_trips_through_the_receipt_and_earlier_receipts_hash_as_before(policy):
    receipt = parse_receipt(raw("a"))
    assert "unverifiable" not in receipt.model_dump(mode="json")["canary"]
    again = parse_receipt(unverifiable(receipt).model_dump(mode="json"))
    assert again.canary.unverifiable == UNVERIFIABLE


def test_continual_learning_reports_the_canary_unavailable_rather_than_pausing_for_it(policy):
    decision = stop_decision(unverifiable(parse_receipt(raw("a"))), policy)
    assert not any("canary" in r for r in decision.reasons)
    assert any(UNVERIFIABLE in u for u in decision.unavailable)
