"""A graph stopped by a blocking check reads as a diagnosis: evidence never produced is unavailable with the
stage that did not run and the upstream check that stopped it, and span coverage judges the stages that
ran while naming the rollouts never started. Nothing of this can promote."""

from __future__ import annotations

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, evaluate, run_check
from lightning_dagster.gate.receipt import parse_receipt
from lightning_dagster.gate.stages import STAGES
from tests.gate.conftest import raw, set_path

HELDOUT_FAILED = "check 4 (held-out vs exact parent) failed upstream"


def stopped_after_heldout(canary_planned: int = 20) -> dict:
    """A's receipt as the graph leaves it when check 4 fails on holdout_evaluation: no canary, no drill,
    the canary step approved before the graph ran, and the plan expecting canary rollouts."""
    data = raw("a")
    for k in (0, 1):
        set_path(data, f"holdout.families.{k}.candidate_mean", data["holdout"]["families"][k]["parent_mean"])
    data["canary"] = None
    data["rollback_drill"] = None
    data["plan"]["expected_rollouts"]["canary"] = canary_planned
    return data


def by_id(evaluation) -> dict[int, object]:
    return {c.id: c for c in evaluation.checks}


def test_checks_after_a_failed_heldout_check_are_unavailable_naming_the_stage_and_the_cause(policy):
    ev = evaluate(parse_receipt(stopped_after_heldout()), policy)
    checks = by_id(ev)
    assert ev.verdict == HOLD
    assert {c.id: c.status for c in ev.checks if c.status != "pass"} == {
        4: "fail",
        6: "unavailable",
        7: "unavailable",
    }
    assert checks[6].reason == f"canary_results did not run: {HELDOUT_FAILED}"
    assert checks[7].reason == f"rollback_drill did not run: {HELDOUT_FAILED}"
    assert ev.not_run == {"canary_results": HELDOUT_FAILED, "rollback_drill": HELDOUT_FAILED}
    assert f"check 6 (bounded canary) unavailable: canary_results did not run: {HELDOUT_FAILED}" in (
        ev.hold_reasons
    )


def test_missing_approval_is_named_beside_the_stopped_drill(policy):
    data = stopped_after_heldout()
    data["approvals"] = []
    check = by_id(evaluate(parse_receipt(data), policy))[7]
    assert check.status == "unavailable"
    assert check.reason == (
        f"rollback_drill did not run: {HELDOUT_FAILED}; no approval yet from required roles ['release-owner']"
    )


def test_span_coverage_judges_the_stages_that_ran_and_names_the_rollouts_never_started(policy):
    check = by_id(evaluate(parse_receipt(stopped_after_heldout()), policy))[2]
    assert check.status == "pass"
    assert check.figures["planned"] == 120 and check.figures["never_recorded"] == 0
    assert check.figures["never_started"] == {
        "canary_results": {"rollouts": {"canary": 20}, "why": HELDOUT_FAILED}
    }
    assert check.reason.endswith(
        f"; 20 canary expected rollouts never started (canary_results did not run: {HELDOUT_FAILED})"
    )


def test_training_stopped_by_the_first_batch_judges_the_first_batch_only(policy):
    data = raw("a")
    data["plan"]["algorithm"]["tasks_per_step"] = 15  # x group_size 8: the first batch is the 120 recorded
    data["plan"]["expected_rollouts"]["train"] = 240
    for section in ("candidate", "holdout", "protected", "canary", "rollback_drill"):
        data[section] = None
    for i in range(30):
        set_path(data, f"rollouts.span_counts.{i}.2", 0)  # 30 first-batch rollouts without a reward span
    ev = evaluate(parse_receipt(data), policy)
    checks = by_id(ev)
    cause = "check 2 (span coverage) failed upstream"
    assert checks[2].status == "fail" and checks[2].figures["planned"] == 120
    assert f"120 train expected rollouts never started (candidate_resource did not run: {cause})" in (
        checks[2].reason
    )
    assert checks[1].status == "unavailable"
    assert checks[1].reason == f"candidate_resource did not run: {cause}"
    for check_id, stage in ((4, "holdout_evaluation"), (5, "holdout_evaluation"), (6, "canary_results")):
        assert checks[check_id].reason == f"{stage} did not run: {cause}"
    assert ev.verdict == HOLD


def test_run_check_alone_names_the_same_cause(policy):
    receipt = parse_receipt(stopped_after_heldout())
    assert run_check(Check.canary_verified, receipt, policy).reason == (
        f"canary_results did not run: {HELDOUT_FAILED}"
    )


def test_evidence_missing_without_an_upstream_failure_keeps_the_plain_finding(policy):
    data = raw("a")
    data["canary"] = None
    data["plan"]["expected_rollouts"]["canary"] = 20
    ev = evaluate(parse_receipt(data), policy)
    checks = by_id(ev)
    assert checks[6].status == "unavailable" and checks[6].reason == "no canary recorded"
    assert ev.not_run == {} and ev.verdict == HOLD
    assert checks[2].figures["never_started"] == {
        "canary_results": {"rollouts": {"canary": 20}, "why": "has not run"}
    }


def test_a_forged_canary_section_without_its_rollouts_fails_coverage(policy):
    data = raw("a")
    data["plan"]["expected_rollouts"]["canary"] = 20  # the canary "ran" but started none of its rollouts
    ev = evaluate(parse_receipt(data), policy)
    coverage = by_id(ev)[2]
    assert coverage.status == "fail" and coverage.figures["never_recorded"] == 20
    assert coverage.figures["never_started"] == {}
    assert ev.verdict == HOLD


def test_the_stage_table_names_each_check_once_in_graph_order():
    blocking = [c for stage in STAGES for c in stage.blocking]
    assert sorted(blocking) == list(Check)
    assert [s.name for s in STAGES] == [
        "rollouts",
        "candidate_resource",
        "holdout_evaluation",
        "canary_results",
        "rollback_drill",
    ]
