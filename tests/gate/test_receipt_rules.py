"""A receipt judged on its own must agree with itself: edits of candidate A (or of the other fixture
receipts) that put a value outside its range, make ids or family names look alike without being equal,
duplicate evidence, or swap values between fields or receipts are refused (invalid input naming the field)
or held with a finding naming the rule, never promoted (the issue's cases one by one, the CLI and harmless
re-serializations: test_receipt_rules_cases.py)."""

from __future__ import annotations

import copy
import unicodedata
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import HOLD, PROMOTE, evaluate
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.policy import load_policy
from lightning_dagster.gate.receipt import parse_receipt
from tests.gate.conftest import example_approvers, get_path, raw, resign_approval, set_path

ROLES = example_approvers()
NOW = raw("a")["plan"]["created_at"] + 86_400.0
SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
Edit = Callable[[dict[str, Any]], Any]

# Characters a reader cannot see (format, zero-width, bidi, separators other than the space, controls) and
# blanks that surround a name; letters whose NFD form differs from their NFC form.
INVISIBLE = ["\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\u202e", "\u200e", "\u2063"]
INVISIBLE += ["\u00a0", "\u2009", "\u3000", "\u2028", "\x00", "\x7f"]
BLANKS = [" ", "\t", "\n", "\u00a0", "\u2009"]
DECOMPOSABLE = "éüñÅçőṩ"  # each with a canonical decomposition
# Paths of A's receipt that hold ids or names ({i}: an index drawn below its bound)
NAME_PATHS = [
    ("receipt_id", 0),
    ("plan.candidate_id", 0),
    ("plan.parent.resource_id", 0),
    ("plan.parent.uri", 0),
    ("plan.train_snapshot.snapshot_id", 0),
    ("plan.holdout_snapshot.content_hash", 0),
    ("plan.canary_snapshot.task_ids.{i}", 20),
    ("plan.evaluator.version", 0),
    ("plan.approvers.canary.{i}", 2),
    ("plan.code_revision", 0),
    ("rollouts.rollout_ids.{i}", 120),
    ("rollouts.families.{i}", 3),
    ("candidate.resource_id", 0),
    ("holdout.families.{i}.family", 2),
    ("protected.families.{i}.family", 2),
    ("canary.tasks.{i}.task_id", 20),
    ("canary.tasks.{i}.destination", 20),
    ("canary.limits.allowed_tools.{i}", 2),
    ("canary.usage.side_effects.{i}", 2),
    ("rollback_drill.parent_id", 0),
    ("approvals.0.actor", 0),
    ("approvals.0.role", 0),
]
# (path, in [0, 1]?) of shares and means, and of amounts that are never negative
RANGED = [
    ("holdout.families.{i}.candidate_mean", True),
    ("holdout.families.{i}.parent_mean", True),
    ("canary.tasks.{i}.uncertainty", True),
    ("canary.usage.cost", False),
    ("canary.usage.seconds", False),
    ("canary.limits.max_cost", False),
]


def outcome(data: dict[str, Any], policy) -> tuple[str, Any]:
    """What `gate evaluate` does with a receipt (the CLI's own functions, its clock fixed): `refused` and the
    invalid input, or the verdict and the evaluation."""
    try:
        receipt = parse_receipt(data)
    except InvalidInput as err:
        return "refused", err
    return (ev := evaluate(receipt, policy, None, roles=ROLES, now=NOW)).verdict, ev


def rename(node: Any, old: str, new: str) -> Any:
    """`node` with every string equal to `old` (values and keys) replaced by `new`."""
    if isinstance(node, dict):
        return {rename(k, old, new): rename(v, old, new) for k, v in node.items()}
    if isinstance(node, list):
        return [rename(v, old, new) for v in node]
    return new if node == old else node


def test_a_promotes_under_the_roles_and_clock_used_here(policy):
    assert outcome(raw("a"), policy)[0] == PROMOTE


# ---------------------------------------------------------------- generated edits


@st.composite
def look_alike_name(draw) -> tuple[str, Edit, str | None]:
    """An id or family name of A made to look like itself (an invisible character, surrounding blanks, a
    letter in NFD form), here only or everywhere it occurs. -> (kind, edit, the field refused or None)."""
    template, bound = draw(st.sampled_from(NAME_PATHS))
    path = template.format(i=draw(st.integers(0, max(bound - 1, 0))))
    how = draw(st.sampled_from(["invisible", "blank", "nfd"]))

    def variant(value: str) -> str:
        if how == "invisible":
            at = draw(st.integers(0, len(value)))
            return value[:at] + draw(st.sampled_from(INVISIBLE)) + value[at:]
        if how == "blank":
            blank = draw(st.sampled_from(BLANKS))
            return draw(st.sampled_from([blank + value, value + blank, blank + value + blank]))
        return value + unicodedata.normalize("NFD", draw(st.sampled_from(DECOMPOSABLE)))

    new = variant(get_path(raw("a"), path))
    if draw(st.booleans()):  # here only: it also no longer equals its other occurrences
        return f"{how} at {path}", lambda d: set_path(d, path, new), path
    old = get_path(raw("a"), path)  # everywhere: the receipt agrees with itself, on a name no one can read
    return f"{how} everywhere for {path}", lambda d: d.update(rename(d, old, new)), None


@st.composite
def out_of_range(draw) -> tuple[str, Edit, str]:
    template, share = draw(st.sampled_from(RANGED))
    path = template.format(i=draw(st.integers(0, 1)))
    below = st.floats(max_value=0.0, exclude_max=True, allow_nan=False, allow_infinity=False)
    above = st.floats(min_value=1.0, exclude_min=True, allow_nan=False, allow_infinity=False)
    value = draw(st.one_of(below, above) if share else below)
    return f"{path}={value!r}", lambda d: set_path(d, path, value), path


@st.composite
def contradiction(draw) -> tuple[str, Edit, set[Check]]:
    """An edit that leaves every value well-formed but contradicts other evidence; the approval is signed
    again over the edited evidence (as if its approver were fooled), so the rule, not the signature, holds
    it. -> (kind, edit, the checks of which at least one must fail)."""
    kind = draw(
        st.sampled_from(
            [
                "rollout id repeated",
                "span family column repeated",
                "held-out family repeated",
                "protected family repeated",
                "canary task repeated",
                "candidate artifact is the parent's",
                "snapshots of two splits equal",
                "canary task not planned",
                "verified without destination",
                "verified with uncertainty",
                "canary limit raised",
                "canary tools or destinations widened",
            ]
        )
    )
    k, j = draw(st.lists(st.integers(0, 19), min_size=2, max_size=2, unique=True))
    if kind == "rollout id repeated":
        return (
            kind,
            lambda d: set_path(d, f"rollouts.rollout_ids.{j}", d["rollouts"]["rollout_ids"][k]),
            {2, 3},
        )
    if kind == "span family column repeated":
        column = draw(st.integers(0, 2))

        def edit(d):
            ro = d["rollouts"]
            ro["families"].append(ro["families"][column])
            ro["span_counts"] = [row + [row[column]] for row in ro["span_counts"]]

        return kind, edit, {2, 3}
    if kind in ("held-out family repeated", "protected family repeated"):
        section = "holdout" if kind.startswith("held") else "protected"
        i = k % 2
        return (
            kind,
            lambda d: set_path(d, f"{section}.families.{1 - i}", copy.deepcopy(d[section]["families"][i])),
            {Check.heldout_margin if section == "holdout" else Check.protected_cases},
        )
    if kind == "canary task repeated":
        return kind, lambda d: set_path(d, f"canary.tasks.{j}", copy.deepcopy(d["canary"]["tasks"][k])), {6}
    if kind == "candidate artifact is the parent's":
        field = draw(st.sampled_from(["resource_id", "uri", "weights_hash"]))
        return kind, lambda d: d["candidate"].update({field: d["plan"]["parent"][field]}), {1}
    if kind == "snapshots of two splits equal":
        a, b = draw(
            st.lists(
                st.sampled_from(["train", "holdout", "protected", "canary"]),
                min_size=2,
                max_size=2,
                unique=True,
            )
        )
        field = draw(st.sampled_from(["snapshot_id", "content_hash"]))
        return (
            kind,
            lambda d: set_path(d, f"plan.{a}_snapshot.{field}", d["plan"][f"{b}_snapshot"][field]),
            {1},
        )
    if kind == "canary task not planned":
        other = draw(st.sampled_from(["canary-20", "canary-99", "ro-a-000", "prot-arith-00", "arithmetic"]))
        return kind, lambda d: set_path(d, f"canary.tasks.{k}.task_id", other), {6}
    if kind == "verified without destination":
        return kind, lambda d: set_path(d, f"canary.tasks.{k}.destination", None), {6}
    if kind == "verified with uncertainty":
        u = draw(st.floats(0.0, 1.0, exclude_min=True))
        return kind, lambda d: set_path(d, f"canary.tasks.{k}.uncertainty", u), {6}
    if kind == "canary limit raised":  # and used: the canary ran beyond the policy's limit
        name, used = draw(
            st.sampled_from([("max_tasks", None), ("max_seconds", "seconds"), ("max_cost", "cost")])
        )
        cap = getattr(load_policy().checks.canary_verified, name)
        raised = draw(st.integers(cap + 1, 10**6)) if name == "max_tasks" else draw(st.floats(cap + 1, 1e9))

        def edit(d):
            d["canary"]["limits"][name] = raised
            if used:
                d["canary"]["usage"][used] = raised

        return kind, edit, {6}
    widened = draw(st.sampled_from(["allowed_tools", "allowed_side_effects"]))

    def edit(d):
        d["canary"]["limits"][widened].append("shell" if widened == "allowed_tools" else "https://elsewhere")
        if widened == "allowed_side_effects":
            d["canary"]["tasks"][k]["destination"] = "https://elsewhere"
            d["canary"]["usage"]["side_effects"].append("https://elsewhere")
        else:
            d["canary"]["usage"]["tools_used"].append("shell")

    return kind, edit, {6}


@st.composite
def after_approval(draw) -> tuple[str, dict[str, Any]]:
    """Evidence changed after it was approved, or taken from another receipt under A's id and approval: the
    approval binds the evidence hash it signed, so it no longer counts. -> (kind, receipt data)."""
    kind = draw(
        st.sampled_from(
            [
                "section of another receipt",
                "evidence of another receipt",
                "regressions deleted",
                "plan rewritten",
                "approval duplicated",
            ]
        )
    )
    other = draw(st.sampled_from("bcd"))
    data = raw("a")
    if kind == "section of another receipt":
        section = draw(st.sampled_from(["rollouts", "candidate", "holdout", "protected", "canary"]))
        data[section] = raw(other)[section]
    elif kind == "evidence of another receipt":
        data = {**raw(other), "receipt_id": data["receipt_id"], "approvals": data["approvals"]}
    elif kind == "regressions deleted":  # C's three regressions, gone after C was approved
        data = raw("c")
        data["protected"]["families"][0]["regressed"] = []
    elif (
        kind == "plan rewritten"
    ):  # to fit a failure: rollout 5 lacks its reward span, the plan no longer asks for it
        data["rollouts"]["span_counts"][5][2] = 0
        data["plan"]["expected_span_families"]["train"] = ["llm", "tool"]
    else:
        data["approvals"] = data["approvals"] * draw(st.integers(2, 4))
    return kind, data


@SETTINGS
@given(st.one_of(look_alike_name(), out_of_range()))
def test_a_malformed_name_or_an_out_of_range_value_is_refused_naming_it(policy, case):
    kind, edit, field = case
    data = raw("a")
    edit(data)
    verdict, err = outcome(data, policy)
    assert verdict == "refused", (kind, err.hold_reasons)
    assert field is None or field in err.fields, (kind, str(err))


@SETTINGS
@given(contradiction())
def test_evidence_contradicting_itself_is_held_by_the_rule_it_breaks(policy, case):
    kind, edit, touched = case
    data = raw("a")
    edit(data)
    resign_approval(data, 0)
    verdict, ev = outcome(data, policy)
    assert verdict == HOLD, kind
    failing = {c.id for c in ev.checks if c.status == "fail"}
    assert failing & touched, (kind, [c.reason for c in ev.checks if c.status != "pass"])


@SETTINGS
@given(after_approval())
def test_an_approval_counts_only_for_the_evidence_it_signed_and_once(policy, case):
    kind, data = case
    verdict, ev = outcome(data, policy)
    assert verdict == HOLD, kind
    check7 = ev.checks[Check.rollback_and_approval - 1]
    assert check7.status == "fail" and "inconsistent evidence" in check7.reason, (kind, check7.reason)
