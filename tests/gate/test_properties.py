"""Property tests: missing evidence never passes, any single failing check holds, the verdict is
deterministic, and the receipt hash sees every field."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_dagster.gate.checks import HOLD, evaluate
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.receipt import parse_receipt, receipt_hash
from tests.gate.conftest import get_path, raw, set_path

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# (path, the "unavailable" value, the checks that evidence feeds)
REMOVABLE: list[tuple[str, Any, set[int]]] = [
    ("candidate", None, {1}),
    ("plan.parent.resolves", None, {1}),
    ("plan.parent.loads", None, {1}),
    ("plan.parent.weights_hash", None, {1}),
    ("rollouts", None, {2, 3}),
    ("rollouts.span_counts.0", None, {2}),
    ("rollouts.span_counts.119", None, {2}),
    ("holdout", None, {4}),
    ("holdout.families.0.candidate_mean", None, {4}),
    ("holdout.families.1.parent_mean", None, {4}),
    ("protected", None, {5}),
    ("protected.families.0.missing", 1, {5}),
    ("canary", None, {6}),
    ("canary.usage", None, {6}),
    ("canary.tasks.0.harmful_effect", None, {6}),
    ("canary.tasks.19.harmful_effect", None, {6}),
    ("rollback_drill", None, {7}),
    ("rollback_drill.resolved", None, {7}),
    ("rollback_drill.routed_back", None, {7}),
    ("approvals", [], {7}),
]


@SETTINGS
@given(st.lists(st.sampled_from(REMOVABLE), min_size=1, max_size=6, unique_by=lambda r: r[0]))
def test_missing_evidence_never_yields_pass(policy, removals):
    data = raw("a")
    # remove deeper paths first so that removing a parent section does not hide them
    for path, value, _ in sorted(removals, key=lambda r: -r[0].count(".")):
        set_path(data, path, value)
    ev = evaluate(parse_receipt(data), policy)
    fed = set().union(*(checks for _, _, checks in removals))
    for c in ev.checks:
        if c.id in fed:
            assert c.status != "pass", (c.id, c.reason)
    assert ev.verdict == HOLD


@SETTINGS
@given(
    st.sampled_from(
        [
            "evaluator",
            "tool_contract",
            "task_distribution",
            "parent",
            "serving_model",
            "retry_policy",
            "permissions",
            "destinations",
        ]
    )
)
def test_missing_fingerprint_voids_and_holds(policy, name):
    data = set_path(raw("a"), f"fingerprints.{name}", None)
    ev = evaluate(parse_receipt(data), policy)
    assert ev.verdict == HOLD and ev.stale_checks


@st.composite
def single_failure(draw) -> tuple[int, dict]:
    """A's receipt with one check made to fail, by a randomly sized change."""
    data = raw("a")
    check = draw(st.integers(1, 7))
    if check == 1:
        path = draw(st.sampled_from(["plan.parent.resolves", "plan.parent.loads"]))
        set_path(data, path, False)
    elif check == 2:
        i = draw(st.integers(0, 119))
        if draw(st.booleans()):
            status = draw(st.sampled_from(["failed", "cancelled", "running"]))
            set_path(data, f"rollouts.statuses.{i}", status)
            if status == "failed":  # a failed rollout's latest attempt failed too (else: inconsistent)
                last = max(k for k, j in enumerate(data["rollouts"]["attempt_rollout"]) if j == i)
                set_path(data, f"rollouts.attempt_endings.{last}", "failed")
        else:
            set_path(data, f"rollouts.span_counts.{i}.{draw(st.integers(0, 2))}", 0)
    elif check == 3:
        set_path(data, "plan.retry_budget.infrastructure_retries", draw(st.integers(0, 1)))
    elif check == 4:
        margin = draw(st.floats(-0.5, 0.0199))
        for k in (0, 1):
            parent = get_path(data, f"holdout.families.{k}.parent_mean")
            set_path(data, f"holdout.families.{k}.candidate_mean", parent + margin)
    elif check == 5:
        k = draw(st.integers(1, 10))
        set_path(data, "protected.families.1.regressed", [f"case-{j}" for j in range(k)])
    elif check == 6:
        for i in draw(st.lists(st.integers(0, 19), min_size=1, max_size=20, unique=True)):
            set_path(data, f"canary.tasks.{i}.verified", False)
    else:
        set_path(
            data, f"rollback_drill.{draw(st.sampled_from(['resolved', 'loaded', 'routed_back']))}", False
        )
    return check, data


@SETTINGS
@given(single_failure())
def test_any_single_failing_check_yields_hold(policy, case):
    check, data = case
    ev = evaluate(parse_receipt(data), policy)
    assert ev.verdict == HOLD
    assert {c.id: c.status for c in ev.checks if c.status != "pass"} == {check: "fail"}


@SETTINGS
@given(single_failure())
def test_verdict_is_deterministic(policy, case):
    _, data = case
    first = evaluate(parse_receipt(data), policy).to_json_dict()
    again = evaluate(parse_receipt(data), policy).to_json_dict()
    # a JSON round trip with reversed key order must not change anything either
    reordered = json.loads(json.dumps(dict(reversed(list(data.items())))))
    third = evaluate(parse_receipt(reordered), policy).to_json_dict()
    assert first == again == third


def _leaves(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _leaves(v, f"{prefix}{k}.")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _leaves(v, f"{prefix}{i}.")]
    return [prefix[:-1]] if node is not None else []


LEAVES = _leaves(raw("a"))


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.25
    return value + "x"


@SETTINGS
@given(st.sampled_from(LEAVES))
def test_receipt_hash_changes_when_any_field_changes(path):
    data = raw("a")
    before = receipt_hash(parse_receipt(data))
    set_path(data, path, _changed(get_path(data, path)))
    try:
        changed = parse_receipt(data)
    except InvalidInput:
        assume(False)  # e.g. an enum value that no longer validates: nothing to hash
    assert receipt_hash(changed) != before


def test_receipt_hash_ignores_key_order_and_the_gate_record(receipt_a, policy):
    from lightning_dagster.gate.receipt import with_gate_record

    data = raw("a")
    reordered = parse_receipt(json.loads(json.dumps(data, sort_keys=True)))
    assert receipt_hash(reordered) == receipt_hash(receipt_a)
    ev = evaluate(receipt_a, policy)
    recorded = with_gate_record(receipt_a, ev.to_record())
    assert receipt_hash(recorded) == ev.receipt_hash == receipt_hash(receipt_a)
    assert evaluate(recorded, policy).verdict == ev.verdict
