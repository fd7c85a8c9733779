"""The issue's self-contradicting receipts one by one (refused naming the field, or held naming the rule),
a policy that takes the default's name, `gate evaluate` run as a subprocess, and re-serializations of the
fixture receipts that must keep their verdict. The generated edits are in test_receipt_rules.py."""

from __future__ import annotations

import copy
import json
import random
import subprocess
import sys
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_dagster.cli import main
from lightning_dagster.gate.checks import HOLD, PROMOTE, evaluate
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.policy import load_policy
from lightning_dagster.gate.receipt import load_receipt, parse_receipt, receipt_hash
from tests.gate.conftest import EXAMPLES, PIPELINE_PUB, raw, resign_approval, set_path
from tests.gate.test_receipt_rules import NOW, ROLES, outcome


def _c_without_regressions(d: dict[str, Any]) -> None:
    d.clear()
    d.update(raw("c"))
    d["protected"]["families"][0]["regressed"] = []


def _evidence_of_c_under_a(d: dict[str, Any]) -> None:
    a = raw("a")
    _c_without_regressions(d)
    d.update(receipt_id=a["receipt_id"], approvals=a["approvals"])


def _plan_fits_failure(d: dict[str, Any]) -> None:
    d["rollouts"]["span_counts"][5][2] = 0
    d["plan"]["expected_span_families"]["train"] = ["llm", "tool"]


def _canary_limits_raised(d: dict[str, Any]) -> None:
    d["canary"]["limits"]["max_cost"] = 100.0
    d["canary"]["usage"]["cost"] = 50.0


def _family_twice(d: dict[str, Any]) -> None:
    d["holdout"]["families"].append({**d["holdout"]["families"][0], "family": "arithmetic "})


# (case, edit, sign the edited evidence again?, the check held or "refused", a fragment of its reason)
LISTED = [
    (
        "verified, no destination",
        lambda d: set_path(d, "canary.tasks.3.destination", None),
        True,
        6,
        "canary.tasks.3 (canary-03) is verified with no destination",
    ),
    (
        "candidate_mean 50.0",
        lambda d: set_path(d, "holdout.families.0.candidate_mean", 50.0),
        True,
        "refused",
        "holdout.families.0.candidate_mean",
    ),
    (
        "parent_mean -1e300",
        lambda d: set_path(d, "holdout.families.1.parent_mean", -1e300),
        True,
        "refused",
        "holdout.families.1.parent_mean",
    ),
    (
        "candidate artifact is the parent's",
        lambda d: d["candidate"].update(uri=d["plan"]["parent"]["uri"]),
        True,
        1,
        "candidate uri equals the parent's",
    ),
    (
        "canary ran unplanned tasks",
        lambda d: set_path(d, "canary.tasks.0.task_id", "canary-99"),
        True,
        6,
        "canary tasks ['canary-99'] are not among the plan's",
    ),
    (
        "rollout ids differ by an invisible character",
        lambda d: set_path(d, "rollouts.rollout_ids.1", "ro-a-000\u200b"),
        False,
        "refused",
        "rollouts.rollout_ids.1",
    ),
    (
        "family twice, once with a trailing space",
        _family_twice,
        False,
        "refused",
        "holdout.families.2.family",
    ),
    (
        "another receipt's evidence under A's id and approval",
        _evidence_of_c_under_a,
        False,
        7,
        "not this receipt's",
    ),
    ("regressions deleted after the approval", _c_without_regressions, False, 7, "not this receipt's"),
    (
        "verified at the highest uncertainty",
        lambda d: [t.update(uncertainty=1.0) for t in d["canary"]["tasks"]],
        True,
        6,
        "is verified with uncertainty 1.0",
    ),
    (
        "the receipt raises its own canary limits",
        _canary_limits_raised,
        True,
        6,
        "canary.limits.max_cost 100.0 exceeds the policy's 2.0",
    ),
    (
        "held-out snapshot is the train snapshot",
        lambda d: set_path(
            d, "plan.holdout_snapshot.content_hash", d["plan"]["train_snapshot"]["content_hash"]
        ),
        True,
        1,
        "plan.train_snapshot is plan.holdout_snapshot",
    ),
    ("plan rewritten to fit its failures", _plan_fits_failure, False, 7, "not this receipt's"),
    (
        "approval duplicated",
        lambda d: d["approvals"].append(copy.deepcopy(d["approvals"][0])),
        False,
        7,
        "approvals.1 by alice (canary) repeats an earlier approval",
    ),
]


@pytest.mark.parametrize("edit, resign, held, fragment", [c[1:] for c in LISTED], ids=[c[0] for c in LISTED])
def test_each_listed_self_contradiction_is_refused_or_held_naming_it(policy, edit, resign, held, fragment):
    data = raw("a")
    edit(data)
    if resign:
        try:
            resign_approval(data, 0)
        except InvalidInput:
            pass  # refused before anything could sign it
    verdict, ev = outcome(data, policy)
    if held == "refused":
        assert verdict == "refused" and fragment in ev.fields, ev
        return
    assert verdict == HOLD
    check = ev.checks[held - 1]
    assert check.status == "fail" and fragment in check.reason, check.reason


def test_a_policy_named_like_the_default_must_hash_like_it(tmp_path, capsys):
    text = (EXAMPLES / "policy.yaml").read_text()
    looser = yaml.safe_load(text)
    looser["checks"][4]["min_margin"] = -1.0
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(looser))
    with pytest.raises(InvalidInput) as err:
        load_policy(path)
    assert err.value.fields == ["version"] and load_policy().hash in str(err.value)
    assert main(["gate", "evaluate", str(EXAMPLES / "candidate-a.json"), "--policy-path", str(path)]) == 2
    assert "version" in capsys.readouterr().err
    # the same content in another form is the default; other content under a name of its own is itself
    same = tmp_path / "same.json"
    same.write_text(json.dumps(dict(reversed(list(yaml.safe_load(text).items())))))
    assert load_policy(same).hash == load_policy().hash
    path.write_text(yaml.safe_dump({**looser, "version": "looser-v1"}))
    assert load_policy(path).checks.heldout_margin.min_margin == -1.0


# ---------------------------------------------------------------- the CLI, and harmless re-serializations


@pytest.mark.parametrize(
    "path, value, code, fragment",
    [
        # held by check 6, and unattested: the edit came after the pipeline's signature
        ("canary.tasks.3.destination", None, 3, "canary.tasks.3 (canary-03) is verified with no destination"),
        ("canary.tasks.3.task_id", "canary-03\u2060", 2, "canary.tasks.3.task_id"),
    ],
)
def test_gate_evaluate_as_a_subprocess_holds_or_refuses_naming_the_field(
    tmp_path, path, value, code, fragment
):
    data = set_path(raw("a"), path, value)
    if code == 3:
        resign_approval(data, 0)
    receipt = tmp_path / "receipt.json"
    receipt.write_text(json.dumps(data))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_dagster.cli",
            "gate",
            "evaluate",
            str(receipt),
            "--policy-path",
            str(EXAMPLES / "policy.yaml"),
            "--roles-path",
            str(EXAMPLES / "roles.yaml"),
            "--pipeline-public-key",
            PIPELINE_PUB,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert fragment in (proc.stdout if code == 3 else proc.stderr)
    assert "PROMOTE" not in proc.stdout


def _serialized(node: Any, rng: random.Random) -> str:
    """JSON text of `node` in a random but equivalent form: key order, whitespace, integral floats written
    as integers or in exponent form, characters written as \\u escapes."""
    ws = lambda: rng.choice(["", "", " ", "\n", "\t", "\r\n  "])  # noqa: E731
    if isinstance(node, dict):
        items = list(node.items())
        rng.shuffle(items)
        body = ",".join(
            f"{ws()}{_serialized(k, rng)}{ws()}:{ws()}{_serialized(v, rng)}{ws()}" for k, v in items
        )
        return "{" + body + ws() + "}"
    if isinstance(node, list):
        return "[" + ",".join(ws() + _serialized(v, rng) + ws() for v in node) + ws() + "]"
    if isinstance(node, str):
        return (
            '"'
            + "".join(f"\\u{ord(c):04x}" if rng.random() < 0.3 else json.dumps(c)[1:-1] for c in node)
            + '"'
        )
    if isinstance(node, float):
        forms = [repr(node), format(node, ".17g"), format(node, ".17e")]
        return rng.choice(forms + ([str(int(node))] if node.is_integer() else []))
    return json.dumps(node)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from("abcd"), st.integers(0, 2**64))
def test_a_re_serialized_receipt_keeps_its_verdict(policy, tmp_path, name, seed):
    data, rng = raw(name), random.Random(seed)
    path = tmp_path / f"{name}.json"
    path.write_text(_serialized(data, rng))
    assert json.loads(path.read_text()) == data  # the same JSON value, written differently
    before, after = parse_receipt(data), load_receipt(path)  # `gate evaluate` reads the file so
    assert receipt_hash(after) == receipt_hash(before)
    judged = [evaluate(r, policy, None, roles=ROLES, now=NOW) for r in (before, after)]
    assert [(c.id, c.status) for c in judged[1].checks] == [(c.id, c.status) for c in judged[0].checks]
    assert judged[1].verdict == judged[0].verdict == (PROMOTE if name == "a" else HOLD)


def test_the_fixture_keeps_its_verdicts_under_these_roles_and_clock(policy):
    failing = {n: {c.id for c in outcome(raw(n), policy)[1].checks if c.status != "pass"} for n in "abcd"}
    assert failing == {"a": set(), "b": {2, 3}, "c": {5}, "d": {1, 6, 7}}
