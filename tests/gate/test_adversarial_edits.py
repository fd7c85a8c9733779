"""Property tests of the gate under attack: a harmful single-field edit of candidate A, in any of the
families of contradictory evidence, never yields PROMOTE; a harmless edit never flips its verdict."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, PROMOTE, Evaluation, evaluate
from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt import parse_receipt
from tests.gate.conftest import example_approvers, raw, resign_approval

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
ROLES = example_approvers()
A = raw("a")
T0 = A["plan"]["created_at"]
NOW = T0 + 86_400.0  # judged a day after the plan: every honest time of A lies before it
YEAR_2200 = 7_258_118_400.0

Edit = Callable[[dict[str, Any]], None]


def judge(data: dict[str, Any], policy: Policy) -> Evaluation:
    return evaluate(parse_receipt(data), policy, roles=ROLES, now=NOW)


def test_candidate_a_promotes_under_the_roles_and_clock_these_tests_use(policy):
    assert judge(raw("a"), policy).verdict == PROMOTE


def _drop_attempts_except(data: dict[str, Any], keep: set[int]) -> None:
    ro = data["rollouts"]
    rows = [k for k, i in enumerate(ro["attempt_rollout"]) if i in keep]
    for column in ("attempt_rollout", "attempt_endings", "attempt_retry_kinds", "attempt_reasons"):
        ro[column] = [ro[column][k] for k in rows]


@st.composite
def harmful_edit(draw) -> tuple[str, set[Check], Edit]:
    """(family, the checks the edit touches, the edit). Each edit changes one field of A's receipt."""
    family = draw(
        st.sampled_from(
            [
                "heldout_family_copied",
                "heldout_family_inflated",
                "rollout_ids_repeated",
                "canary_task_repeated",
                "canary_tasks_dropped",
                "protected_family_dropped",
                "protected_family_emptied",
                "attempts_missing",
                "attempt_endings_contradict",
                "approval_time",
                "default_approved_early",
                "stage_time",
                "weights_hash_of_parent",
                "unknown_approver",
                "canary_usage_count",
            ]
        )
    )
    if family == "heldout_family_copied":
        k = draw(st.integers(0, 1))

        def edit(d):
            d["holdout"]["families"][1 - k] = copy.deepcopy(d["holdout"]["families"][k])

        return family, {Check.heldout_margin}, edit
    if family == "heldout_family_inflated":
        k, n = draw(st.integers(0, 1)), draw(st.integers(61, 100_000))

        def edit(d):
            d["holdout"]["families"][k]["n"] = n

        return family, {Check.heldout_margin}, edit
    if family == "rollout_ids_repeated":
        if draw(st.booleans()):

            def edit(d):
                d["rollouts"]["rollout_ids"] = [d["rollouts"]["rollout_ids"][0]] * 120
        else:
            i, j = draw(st.lists(st.integers(0, 119), min_size=2, max_size=2, unique=True))

            def edit(d):
                d["rollouts"]["rollout_ids"][j] = d["rollouts"]["rollout_ids"][i]

        return family, {Check.span_coverage, Check.retry_debt}, edit
    if family == "canary_task_repeated":
        k = draw(st.integers(0, 19))
        copies = draw(st.lists(st.integers(0, 19).filter(lambda j: j != k), min_size=1, unique=True))

        def edit(d):
            for j in copies:
                d["canary"]["tasks"][j] = copy.deepcopy(d["canary"]["tasks"][k])

        return family, {Check.canary_verified}, edit
    if family == "canary_tasks_dropped":
        dropped = draw(st.lists(st.integers(0, 19), min_size=1, max_size=19, unique=True))

        def edit(d):
            d["canary"]["tasks"] = [t for k, t in enumerate(d["canary"]["tasks"]) if k not in dropped]

        return family, {Check.canary_verified}, edit
    if family == "protected_family_dropped":
        k = draw(st.integers(0, 1))

        def edit(d):
            del d["protected"]["families"][k]

        return family, {Check.protected_cases}, edit
    if family == "protected_family_emptied":
        k = draw(st.integers(0, 1))

        def edit(d):
            d["protected"]["families"][k]["n"] = 0

        return family, {Check.protected_cases}, edit
    if family == "attempts_missing":
        keep = set(draw(st.lists(st.integers(0, 119), max_size=119, unique=True)))
        return family, {Check.span_coverage, Check.retry_debt}, lambda d: _drop_attempts_except(d, keep)
    if family == "attempt_endings_contradict":
        ending = draw(st.sampled_from(["failed", "timeout", "unresponsive", "cancelled", "running"]))
        every = draw(st.booleans())
        k = draw(st.integers(0, 119))

        def edit(d):
            ro = d["rollouts"]
            if every:
                ro["attempt_endings"] = [ending] * len(ro["attempt_endings"])
            else:  # the latest attempt of rollout k
                last = max(j for j, i in enumerate(ro["attempt_rollout"]) if i == k)
                ro["attempt_endings"][last] = ending

        return family, {Check.span_coverage, Check.retry_debt}, edit
    if family == "approval_time":
        at = draw(
            st.one_of(
                st.just(0.0),
                st.just(YEAR_2200),
                st.floats(-1e12, T0 - 1, allow_nan=False),  # before the receipt was created
                st.floats(NOW + 301, 1e15, allow_nan=False),  # beyond now plus the clock skew
            )
        )

        def edit(d):
            d["approvals"][0]["at"] = at

        return family, {Check.rollback_and_approval}, edit
    if family == "default_approved_early":  # approving the default before the canary it rests on ran
        at = draw(st.floats(T0, A["canary"]["at"] - 1, allow_nan=False))

        def edit(d):
            d["approvals"].append({**d["approvals"][0], "step": "default", "at": at})

        return family, {Check.rollback_and_approval}, edit
    if family == "stage_time":
        path, check = draw(
            st.sampled_from(
                [
                    (("candidate", "created_at"), Check.pinned),
                    (("holdout", "at"), Check.heldout_margin),
                    (("protected", "at"), Check.protected_cases),
                    (("canary", "at"), Check.canary_verified),
                    (("rollback_drill", "at"), Check.rollback_and_approval),
                ]
            )
        )
        at = draw(st.one_of(st.just(0.0), st.just(YEAR_2200), st.floats(-1e12, T0 - 1, allow_nan=False)))

        def edit(d):
            d[path[0]][path[1]] = at

        return family, {check}, edit
    if family == "weights_hash_of_parent":
        return (
            family,
            {Check.pinned},
            lambda d: d["candidate"].update(weights_hash=d["plan"]["parent"]["weights_hash"]),
        )
    if family == "unknown_approver":
        # a well-formed name (others are refused before judging: tests/gate/test_receipt_rules.py)
        actor = draw(st.from_regex(r"[A-Za-z0-9._-]{1,20}", fullmatch=True).filter(lambda a: a not in ROLES))
        return family, {Check.rollback_and_approval}, lambda d: d["approvals"][0].update(actor=actor)
    n = draw(st.integers(0, 20).filter(lambda n: n != 20))
    return family, {Check.canary_verified}, lambda d: d["canary"]["usage"].update(tasks=n)


@SETTINGS
@given(harmful_edit())
def test_a_harmful_single_field_edit_never_promotes(policy, case):
    family, touched, edit = case
    data = raw("a")
    edit(data)
    ev = judge(data, policy)
    assert ev.verdict == HOLD, family
    failing = {c.id for c in ev.checks if c.status != "pass"}
    assert failing & touched, (family, failing, [c.reason for c in ev.checks if c.status != "pass"])


@st.composite
def harmless_edit(draw) -> Edit:
    """An edit that changes wording or an immaterial figure, not the evidence."""
    text = draw(st.text(min_size=1, max_size=40))
    kind = draw(st.integers(0, 5))
    if kind == 0:  # a reworded reason of a successful attempt
        k = draw(st.integers(0, 139))
        return lambda d: d["rollouts"]["attempt_reasons"].__setitem__(
            k % len(d["rollouts"]["attempt_reasons"]), text
        )
    if kind == 1:  # a reworded canary evidence text
        k = draw(st.integers(0, 19))
        return lambda d: d["canary"]["tasks"][k].update(evidence=text)
    if kind == 2:
        return lambda d: d["plan"].update(scope=text)
    if kind == 3:  # an approval signed a little later, still before now
        delay = draw(st.floats(0, NOW - A["approvals"][0]["at"], allow_nan=False))

        def later(d: dict[str, Any]) -> None:
            d["approvals"][0].update(at=d["approvals"][0]["at"] + delay)
            resign_approval(d, 0)

        return later
    if kind == 4:  # a faster canary
        seconds = draw(st.floats(0, 900, allow_nan=False))
        return lambda d: d["canary"]["usage"].update(seconds=seconds)
    prefix = draw(st.from_regex(r"[a-z]{1,6}-", fullmatch=True))
    return lambda d: d["rollouts"].update(rollout_ids=[prefix + r for r in d["rollouts"]["rollout_ids"]])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(harmless_edit())
def test_a_harmless_edit_does_not_flip_the_verdict(policy, edit):
    data = raw("a")
    edit(data)
    resign_approval(data, 0)  # the approval binds the evidence it approved: alice approves the edited one
    assert judge(data, policy).verdict == PROMOTE


@pytest.mark.parametrize("now", [T0 + 7299.0, T0 - 1.0])
def test_an_approval_recorded_after_the_judging_clock_plus_skew_holds(policy, now):
    # a judge whose clock is behind the receipt's times sees evidence from the future
    ev = evaluate(parse_receipt(raw("a")), policy, roles=ROLES, now=now, clock_skew_s=0.0)
    assert ev.verdict == HOLD
    assert "in the future" in ev.checks[Check.rollback_and_approval - 1].reason
