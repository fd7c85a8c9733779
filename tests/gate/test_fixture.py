"""The reference fixture: four candidates that all improve reward; only A promotes, and changing one field
of A's receipt flips exactly the check it feeds."""

from __future__ import annotations

import pytest

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, PROMOTE, evaluate
from lightning_dagster.gate.policy import load_policy
from lightning_dagster.gate.receipt import parse_receipt
from tests.gate.conftest import EXAMPLES, raw, set_path, with_threshold


def not_passing(evaluation) -> dict[int, str]:
    return {c.id: c.status for c in evaluation.checks if c.status != "pass"}


@pytest.mark.parametrize(
    "name, verdict, failed",
    [
        ("a", PROMOTE, {}),
        ("b", HOLD, {2: "fail", 3: "fail"}),
        ("c", HOLD, {5: "fail"}),
        ("d", HOLD, {1: "fail", 6: "fail", 7: "fail"}),
    ],
)
def test_reference_candidates_get_their_verdict_and_exact_failed_checks(policy, name, verdict, failed):
    ev = evaluate(parse_receipt(raw(name)), policy)
    assert ev.verdict == verdict
    assert not_passing(ev) == failed
    assert ev.stale_checks == []
    assert len(ev.hold_reasons) == len(failed)


def test_every_candidate_improves_held_out_reward_and_the_largest_gain_loses(policy):
    margins = {n: evaluate(parse_receipt(raw(n)), policy).checks[3].figures["margin"] for n in "abcd"}
    assert all(m > 0 for m in margins.values())
    assert max(margins, key=margins.get) == "c"
    assert margins["a"] == pytest.approx(0.04)


def test_fixture_figures_match_the_story(policy):
    b = evaluate(parse_receipt(raw("b")), policy)
    assert (b.checks[1].figures["complete"], b.checks[1].figures["planned"]) == (83, 120)
    assert b.checks[2].figures["unexpected_retries"] == 14
    c = evaluate(parse_receipt(raw("c")), policy)
    assert c.checks[4].figures["regressed"] == 3
    d = evaluate(parse_receipt(raw("d")), policy)
    assert (d.checks[5].figures["verified"], d.checks[5].figures["tasks"]) == (18, 20)
    assert d.checks[0].figures["parent_resolves"] is False


def test_example_policy_is_the_packaged_default(policy):
    assert policy.hash == load_policy().hash
    assert policy.version == "default-v1"


def test_fixture_files_are_reproducible(tmp_path):
    import runpy

    module = runpy.run_path(str(EXAMPLES / "make_fixtures.py"))
    for path in module["write"](tmp_path):
        assert path.read_bytes() == (EXAMPLES / path.name).read_bytes(), path.name


FLIPS = [
    # (path in A's receipt, new value, the one check it feeds, its new status)
    ("plan.parent.loads", False, 1, "fail"),
    ("plan.parent.resolves", None, 1, "unavailable"),
    ("plan.code_revision", "main", 1, "fail"),
    ("candidate.weights_hash", None, 1, "unavailable"),
    ("candidate.parent_id", "res-someone-else", 1, "fail"),
    ("rollouts.statuses.5", "cancelled", 2, "fail"),
    ("rollouts.span_counts.7.2", 0, 2, "fail"),
    ("rollouts.span_counts.7", None, 2, "unavailable"),
    ("plan.expected_rollouts.train", 121, 2, "fail"),
    ("plan.retry_budget.infrastructure_retries", 1, 3, "fail"),
    ("plan.retry_budget.expected_sample_retries", 9, 3, "fail"),
    ("holdout.families.0.candidate_mean", 0.50, 4, "fail"),
    ("holdout.parent_id", "res-parent-latest", 4, "fail"),
    ("holdout.families.1.parent_mean", None, 4, "unavailable"),
    ("protected.families.0.regressed", ["prot-arith-00"], 5, "fail"),
    ("protected.families.1.missing", 2, 5, "unavailable"),
    ("protected", None, 5, "unavailable"),
    ("canary.tasks.3.verified", False, 6, "fail"),
    ("canary.tasks.3.harmful_effect", True, 6, "fail"),
    ("canary.tasks.3.harmful_effect", None, 6, "unavailable"),
    ("canary.usage.cost", 5.0, 6, "fail"),
    ("canary.serving_resource_id", "res-parent-7f3a", 6, "fail"),
    ("rollback_drill.routed_back", False, 7, "fail"),
    ("rollback_drill.loaded", None, 7, "unavailable"),
    ("approvals", [], 7, "unavailable"),
    ("approvals.0.role", "intern", 7, "fail"),
]


@pytest.mark.parametrize("path, value, check_id, status", FLIPS, ids=[f"{p}={v!r}" for p, v, *_ in FLIPS])
def test_changing_one_field_of_a_flips_exactly_the_check_it_feeds(policy, path, value, check_id, status):
    ev = evaluate(parse_receipt(set_path(raw("a"), path, value)), policy)
    assert not_passing(ev) == {check_id: status}
    assert ev.verdict == HOLD
    assert ev.hold_reasons[0].startswith(f"check {check_id} ")


def test_policy_threshold_change_flips_exactly_its_check(receipt_a, policy):
    stricter = with_threshold(policy, Check.heldout_margin, min_margin=0.05)
    ev = evaluate(receipt_a, stricter)
    assert not_passing(ev) == {4: "fail"}
    assert ev.policy_hash != policy.hash
