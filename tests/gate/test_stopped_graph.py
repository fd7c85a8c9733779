"""A graph stopped by a blocking check reads as a diagnosis: evidence never produced is unavailable with the
stage that did not run and the upstream check that stopped it, and span coverage judges the stages that
ran while naming the rollouts never started. Nothing of this can promote."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, evaluate, run_check
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.receipt import parse_receipt
from lightning_dagster.gate.stage_table import STAGES, early_stop
from lightning_dagster.pipeline.stages.training import training_run
from lightning_dagster.training.loop import selection_summary
from lightning_dagster.training.selection import CheckpointEval, select, stop_reason
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


# -- training that stopped early -------------------------------------------------------------------------

STOP = "validation regressed at 2 evaluation(s) in a row (steps 4, 5)"


def stopped_early(validation: list[dict] | None = None, **training) -> dict:
    """A's receipt from a run planned for 6 steps of 3 tasks x group 8 (144 train rollouts) that stopped after
    step 5: its 120 recorded train rollouts are the 5 steps that ran."""
    data = raw("a")
    data["plan"]["algorithm"].update(tasks_per_step=3, validation_patience=2)
    data["plan"]["expected_rollouts"]["train"] = 144
    data["candidate"]["training"] = {
        "steps_planned": 6,
        "steps_run": 5,
        "early_stop": STOP,
        "parent_validation_success": 0.5,
        "validation": validation
        if validation is not None
        else [
            {"step": 3, "success": 0.6, "lost": []},
            {"step": 4, "success": 0.55, "lost": []},  # below the best so far
            {"step": 5, "success": 0.65, "lost": ["task-7"]},  # lost a case the parent solved
        ],
        "chosen_step": 3,
        **training,
    }
    return data


def test_a_justified_early_stop_expects_the_steps_that_ran_and_names_the_rest(policy):
    check = by_id(evaluate(parse_receipt(stopped_early()), policy))[2]
    why = f"stopped early after step 5 of 6: {STOP}"
    assert check.status == "pass"
    assert check.figures["planned"] == 120 and check.figures["never_recorded"] == 0
    assert check.figures["never_started"] == {"candidate_resource": {"rollouts": {"train": 24}, "why": why}}
    assert check.reason.endswith(f"; 24 train expected rollouts never started (candidate_resource {why})")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        # the evaluations never regressed twice in a row: nothing justified stopping
        ({"validation": [{"step": 4, "success": 0.6, "lost": []}, {"step": 5, "success": 0.7, "lost": []}]},
         "did not regress 2 evaluation(s) in a row"),
        # it should have stopped at step 4 already, so steps 5's rollouts are not explained by the rule
        ({"validation": [{"step": 3, "success": 0.4, "lost": []}, {"step": 4, "success": 0.4, "lost": []},
                         {"step": 5, "success": 0.3, "lost": []}]},
         "called for a stop before the step where training stopped"),
        ({"validation": [{"step": 2, "success": 0.4, "lost": []}, {"step": 3, "success": 0.3, "lost": []}]},
         "do not end at the last step run"),
        ({"validation": []}, "no validation evaluations were recorded"),
        ({"parent_validation_success": None}, "no validation evaluations were recorded"),
        ({"steps_planned": 8}, "8 planned steps do not match the plan's 144 expected train rollouts"),
        ({"plan_patience": 0}, "the plan's validation_patience 0 never stops a run early"),
    ],
)  # fmt: skip
def test_an_early_stop_the_validation_does_not_justify_keeps_every_planned_rollout(policy, change, problem):
    change = dict(change)
    patience = change.pop("plan_patience", None)
    data = stopped_early(**change)
    if patience is not None:
        data["plan"]["algorithm"]["validation_patience"] = patience
    ev = evaluate(parse_receipt(data), policy)
    check = by_id(ev)[2]
    assert check.status == "fail"
    assert check.figures["never_recorded"] == check.figures["planned"] - 120 > 0
    assert problem in check.figures["early_stop_refused"] and problem in check.reason
    assert "candidate_resource" not in check.figures["never_started"]
    assert ev.verdict == HOLD


def test_a_receipt_without_a_training_record_serialises_as_before():
    receipt = parse_receipt(raw("a"))
    assert receipt.candidate.training is None
    assert "training" not in receipt.model_dump(mode="json")["candidate"]
    assert parse_receipt(stopped_early()).model_dump(mode="json")["candidate"]["training"]["steps_run"] == 5


def test_more_steps_run_than_planned_is_refused():
    with pytest.raises(InvalidInput, match="steps_run 7 exceeds steps_planned 6"):
        parse_receipt(stopped_early(steps_run=7))


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=1, max_size=8),
    patience=st.integers(1, 3),
    every=st.integers(1, 3),
)
def test_every_stop_the_trainer_makes_is_one_the_gate_accepts(runs, patience, every):
    """The trainer's loop (evaluate when due, stop as soon as `stop_reason` says so), recorded as training
    records it, passes the gate's recomputation, and the steps not run are the rollouts not expected."""
    steps_planned = every * len(runs)
    evals: list[CheckpointEval] = []
    stop, steps_run = None, steps_planned
    for i, (success, lost) in enumerate(runs):
        step = every * (i + 1)
        evals.append(CheckpointEval(step, success, ("case-1",) if lost else ()))
        stop = stop_reason(evals, 0.5, patience)
        if stop is not None:
            steps_run = step
            break
    keeper = SimpleNamespace(tasks=[{}] * 4, parent_success=0.5, parent_solved={"case-1"}, evals=evals,
                             early_stop=stop)  # fmt: skip
    summary = selection_summary(0.1, steps_run, keeper, select(evals))
    data = stopped_early()
    data["plan"]["expected_rollouts"]["train"] = 24 * steps_planned
    data["plan"]["algorithm"]["validation_patience"] = patience
    data["candidate"]["training"] = training_run(summary, steps_planned).model_dump(mode="json")
    judged = early_stop(parse_receipt(data))
    if stop is None or steps_run == steps_planned:
        assert judged is None
    else:
        assert judged is not None and judged.problem is None
        assert judged.not_started == 24 * (steps_planned - steps_run)


def test_a_forged_receipt_with_a_huge_validation_list_is_judged_in_one_pass(policy):
    """100k recorded evaluations that never regress twice in a row (a quadratic recomputation would not end):
    the stop is refused and every planned rollout stays expected."""
    n = 100_000
    validation = [{"step": i + 1, "success": 0.5 + 0.4 * (i % 2), "lost": []} for i in range(n)]
    data = stopped_early(validation=validation, steps_planned=n + 1, steps_run=n)
    data["plan"]["expected_rollouts"]["train"] = 24 * (n + 1)
    judged = early_stop(parse_receipt(data))
    assert judged is not None and "did not regress 2 evaluation(s) in a row" in judged.problem
