"""Evidence that contradicts itself fails the check it touches with a reason naming the contradiction;
evidence lacking a field the validation needs is unavailable, never a pass."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.gate.checks import HOLD, evaluate, run_check
from lightning_dagster.gate.receipt import parse_receipt
from lightning_dagster.release.signing import ActorKey, public_key_line
from tests.gate.conftest import example_approvers, raw, set_path

NOW = raw("a")["plan"]["created_at"] + 86_400.0


def _copy_family(d: dict[str, Any]) -> None:
    d["holdout"]["families"][1] = copy.deepcopy(d["holdout"]["families"][0])


def _attempts_of_first_only(d: dict[str, Any]) -> None:
    ro = d["rollouts"]
    keep = [k for k, i in enumerate(ro["attempt_rollout"]) if i == 0]
    for column in ("attempt_rollout", "attempt_endings", "attempt_retry_kinds", "attempt_reasons"):
        ro[column] = [ro[column][k] for k in keep]


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: set_path(d, path, value)


# (what, edit, the checks that fail, a fragment of the reason of the first of them)
CONTRADICTIONS = [
    ("held-out family copied", _copy_family, {4}, "held-out families listed more than once: ['arithmetic']"),
    ("held-out n inflated", _set("holdout.families.0.n", 120), {4}, "has n=120 from 60 distinct tasks"),
    (
        "rollout ids identical",
        lambda d: d["rollouts"].update(rollout_ids=["ro-a-000"] * 120),
        {2, 3},
        "rollout ids are not unique",
    ),
    (
        "canary task repeated",
        lambda d: d["canary"].update(tasks=[d["canary"]["tasks"][0]] * 20),
        {6},
        "canary tasks recorded more than once: ['canary-00']",
    ),
    (
        "canary tasks dropped",
        lambda d: d["canary"].update(tasks=d["canary"]["tasks"][:10]),
        {6},
        "canary usage says 20 tasks, the report lists 10",
    ),
    (
        "protected family dropped",
        lambda d: d["protected"]["families"].pop(1),
        {5},
        "planned protected family format (10 tasks) is missing",
    ),
    ("protected family empty", _set("protected.families.0.n", 0), {5}, "has n=0, the plan has 20"),
    (
        "attempts of 1 rollout",
        _attempts_of_first_only,
        {2, 3},
        "119 of 120 finished rollouts have no attempts",
    ),
    (
        "every attempt failed",
        lambda d: d["rollouts"].update(attempt_endings=["failed"] * len(d["rollouts"]["attempt_endings"])),
        {2, 3},
        "120 finished rollouts disagree with their latest attempt's ending",
    ),
    (
        "approval at 0",
        _set("approvals.0.at", 0.0),
        {7},
        "approval of the canary by alice at 1970-01-01T00:00:00Z precedes the plan",
    ),
    (
        "approval in 2200",
        _set("approvals.0.at", 7_258_118_400.0),
        {7},
        "2200-01-01T00:00:00Z is in the future",
    ),
    (
        "approval before the receipt was created",
        _set("approvals.0.at", 1_796_111_000.0),
        {7},
        "precedes the plan",
    ),
    (
        "default approved before the canary ran",
        lambda d: d["approvals"].append(
            {**d["approvals"][0], "step": "default", "at": d["canary"]["at"] - 1}
        ),
        {7},
        "approval of the default by alice at 2026-12-01T09:29:59Z precedes the canary",
    ),
    ("candidate before the plan", _set("candidate.created_at", 1.0), {1}, "precedes the plan"),
    ("evaluation before training", _set("holdout.at", 1_796_112_001.0), {4}, "precedes the candidate"),
    (
        "weights of the parent",
        lambda d: d["candidate"].update(weights_hash=d["plan"]["parent"]["weights_hash"]),
        {1},
        "candidate weights hash equals the parent's",
    ),
    ("another protected snapshot", _set("protected.snapshot_id", "protected-v1"), {5}, "is not the pinned"),
]


@pytest.mark.parametrize(
    "edit, failing, fragment", [c[1:] for c in CONTRADICTIONS], ids=[c[0] for c in CONTRADICTIONS]
)
def test_a_contradiction_fails_the_check_it_touches_naming_it(policy, edit, failing, fragment):
    data = raw("a")
    edit(data)
    ev = evaluate(parse_receipt(data), policy, now=NOW)
    assert ev.verdict == HOLD
    assert {c.id for c in ev.checks if c.status != "pass"} == failing
    assert all(c.status == "fail" for c in ev.checks if c.id in failing)
    first = next(c for c in ev.checks if c.id == min(failing))
    assert first.reason.startswith("inconsistent evidence: ") and fragment in first.reason, first.reason
    assert fragment in " ".join(first.figures["inconsistent"])


# (a field the validation needs, the check it feeds)
MISSING = [
    ("plan.created_at", 1),
    ("candidate.created_at", 1),
    ("holdout.at", 4),
    ("holdout.families.1.distinct_tasks", 4),
    ("protected.at", 5),
    ("canary.at", 6),
    ("rollback_drill.at", 7),
]


@pytest.mark.parametrize("path, check", MISSING, ids=[m[0] for m in MISSING])
def test_a_field_the_validation_needs_is_unavailable_when_absent(policy, path, check):
    ev = evaluate(parse_receipt(set_path(raw("a"), path, None)), policy, now=NOW)
    assert {c.id: c.status for c in ev.checks if c.status != "pass"} == {check: "unavailable"}


def test_without_family_sizes_the_plan_s_set_size_is_checked(policy):
    data = set_path(raw("a"), "plan.protected_snapshot.families", None)
    assert run_check(5, parse_receipt(data), policy, now=NOW).status == "pass"
    data["protected"]["families"].pop(1)
    result = run_check(5, parse_receipt(data), policy, now=NOW)
    assert (
        result.status == "fail"
        and "protected families count 20 tasks, the plan's protected set has 30" in result.reason
    )
    set_path(data, "plan.protected_snapshot.n_tasks", None)
    assert run_check(5, parse_receipt(data), policy, now=NOW).status == "unavailable"


def test_the_canary_step_may_be_approved_on_the_plan_before_training(policy):
    # the pipeline's flow: plan, approve the canary step, then train, evaluate and run the canary
    data = set_path(raw("a"), "approvals.0.at", raw("a")["plan"]["created_at"] + 1)
    assert evaluate(parse_receipt(data), policy, now=NOW).checks[6].status == "pass"


def test_approvals_must_be_signed_by_an_approver_holding_the_role(policy):
    receipt = parse_receipt(raw("a"))
    known = example_approvers()
    alice = known["alice"]
    assert run_check(7, receipt, policy, roles=known, now=NOW).status == "pass"
    demoted = {"alice": ActorKey(frozenset({"ml-lead"}), alice.public_key)}
    result = run_check(7, receipt, policy, roles=demoted, now=NOW)
    assert result.status == "fail" and "actor 'alice' does not hold role 'release-owner'" in result.reason
    stranger = run_check(7, receipt, policy, roles={"bob": alice}, now=NOW)
    assert (
        stranger.status == "fail"
        and "actor 'alice' is not among the deployment's approvers" in stranger.reason
    )
    other_key = public_key_line(Ed25519PrivateKey.generate())
    forged = {"alice": ActorKey(alice.roles, other_key)}
    result = run_check(7, receipt, policy, roles=forged, now=NOW)
    assert result.status == "fail" and "signature does not verify with alice's key" in result.reason
    unsigned = parse_receipt(set_path(raw("a"), "approvals.0.signature", None))
    result = run_check(7, unsigned, policy, roles=known, now=NOW)
    assert result.status == "fail" and "not signed" in result.reason
