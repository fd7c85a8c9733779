"""`lightning-dagster gate evaluate`: exit 0 promote, 1 hold, 2 invalid input in one line naming the field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_dagster.cli import main
from tests.gate.conftest import EXAMPLES, PIPELINE_PUB, raw, set_path

ROLES = str(EXAMPLES / "roles.yaml")


def run(capsys, *args: str) -> tuple[int, str, str]:
    """`gate evaluate` with the fixture's pipeline key (a receipt written here from `raw` is unattested)."""
    code = main(["gate", "evaluate", *args, "--pipeline-public-key", PIPELINE_PUB])
    out, err = capsys.readouterr()
    return code, out, err


def write_receipt(tmp_path: Path, data: Any, text: str | None = None) -> str:
    path = tmp_path / "receipt.json"
    path.write_text(text if text is not None else json.dumps(data))
    return str(path)


def write_policy(tmp_path: Path, edit) -> str:
    data = yaml.safe_load((EXAMPLES / "policy.yaml").read_text())
    edit(data)
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize("name, code", [("a", 0), ("b", 1), ("c", 1), ("d", 1)])
def test_exit_status_follows_the_verdict(capsys, name, code):
    status, out, _ = run(
        capsys,
        str(EXAMPLES / f"candidate-{name}.json"),
        "--policy-path",
        str(EXAMPLES / "policy.yaml"),
        "--roles-path",
        ROLES,
    )
    assert status == code
    assert ("PROMOTE TO BOUNDED CANARY" in out) == (code == 0)
    assert "verdict:" in out and "default-v1" in out


def test_json_output_has_verdict_and_checks_with_figures(capsys):
    status, out, _ = run(capsys, str(EXAMPLES / "candidate-d.json"), "--json")
    doc = json.loads(out)
    assert status == 1 and doc["verdict"] == "HOLD"
    assert [c["id"] for c in doc["checks"]] == list(range(1, 8))
    assert {c["id"] for c in doc["checks"] if c["status"] == "fail"} == {1, 6, 7}
    canary = doc["checks"][5]
    assert set(canary) >= {"id", "name", "status", "reason", "figures"}
    assert canary["figures"]["verified"] == 18
    assert doc["policy_version"] == "default-v1" and doc["policy_hash"].startswith("sha256:")


def test_changed_fingerprint_voids_checks_through_the_cli(capsys, tmp_path):
    current = tmp_path / "now.json"
    current.write_text(json.dumps({"evaluator": "sha256:new-evaluator"}))
    status, out, _ = run(capsys, str(EXAMPLES / "candidate-a.json"), "--fingerprints", str(current), "--json")
    doc = json.loads(out)
    assert status == 1 and doc["stale_checks"] == [4, 5]


MALFORMED_RECEIPTS = [
    # (path, value, the field the message must name)
    ("plan.retry_budget.infrastructure_retries", "four", "plan.retry_budget.infrastructure_retries"),
    ("plan.parent.resolves", "maybe", "plan.parent.resolves"),
    ("rollouts.span_counts.0.1", -1, "rollouts.span_counts.0.1"),
    ("protected.families.0.n", -3, "protected.families.0.n"),
    ("canary.usage.cost", -0.5, "canary.usage.cost"),
    ("rollouts.statuses", ["succeeded"], "rollouts.statuses"),
    ("rollouts.attempt_rollout.0", 999, "rollouts.attempt_rollout.0"),
    ("approvals.0.step", "everything", "approvals.0.step"),
    ("plan.unexpected", 1, "plan.unexpected"),
    (
        "gate",
        {
            "verdict": "HOLD",
            "policy_version": "v",
            "policy_hash": "h",
            "receipt_hash": "r",
            "failed_checks": [9],
            "unavailable_checks": [],
            "stale_checks": [],
        },
        "gate.failed_checks.0",
    ),
    ("schema_version", 2, "schema_version"),
]


@pytest.mark.parametrize("path, value, field", MALFORMED_RECEIPTS, ids=[m[0] for m in MALFORMED_RECEIPTS])
def test_malformed_receipt_exits_2_naming_the_field(capsys, tmp_path, path, value, field):
    status, out, err = run(capsys, write_receipt(tmp_path, set_path(raw("a"), path, value)))
    assert status == 2 and out == ""
    assert field in err, err


@pytest.mark.parametrize(
    "path",
    [
        "plan.parent.uri",
        "plan.retry_budget",
        "protected.families.0.regressed",
        "canary.tasks.0.harmful_effect",
    ],
)
def test_missing_field_exits_2_naming_it(capsys, tmp_path, path):
    data = raw("a")
    *head, last = path.split(".")
    node = data
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    del node[last]  # an omitted field is never read as a healthy default
    status, _, err = run(capsys, write_receipt(tmp_path, data))
    assert status == 2 and path in err and "required" in err


@pytest.mark.parametrize(
    "literal, field",
    [
        ("NaN", "holdout.families.0.candidate_mean"),
        ("Infinity", "holdout.families.1.parent_mean"),
        ("-Infinity", "canary.tasks.2.uncertainty"),
    ],
)
def test_non_finite_rewards_exit_2_naming_the_field(capsys, tmp_path, literal, field):
    data = set_path(raw("a"), field, "__X__")
    text = json.dumps(data).replace('"__X__"', literal)
    status, _, err = run(capsys, write_receipt(tmp_path, None, text))
    assert status == 2 and field in err, err


def test_non_finite_algorithm_setting_exits_2(capsys, tmp_path):
    text = json.dumps(set_path(raw("a"), "plan.algorithm.lr", "__X__")).replace('"__X__"', "NaN")
    status, _, err = run(capsys, write_receipt(tmp_path, None, text))
    assert status == 2 and "plan.algorithm.lr" in err


def test_unreadable_and_non_json_receipts_exit_2(capsys, tmp_path):
    assert run(capsys, str(tmp_path / "absent.json"))[0] == 2
    assert run(capsys, write_receipt(tmp_path, None, "{not json"))[0] == 2
    assert run(capsys, write_receipt(tmp_path, [1, 2]))[0] == 2


def _del(*keys):
    def edit(data):
        node = data
        for key in keys[:-1]:
            node = node[key]
        del node[keys[-1]]

    return edit


MALFORMED_POLICIES = [
    (lambda d: d.update(schema_version=2), "schema_version"),
    (lambda d: d["checks"].update({8: {"x": 1}}), "checks.8"),
    (lambda d: d["checks"][4].update(min_margin="high"), "checks.4.min_margin"),
    (lambda d: d["checks"][2].update(min_complete_share=1.5), "checks.2.min_complete_share"),
    (lambda d: d["checks"][3].update(max_unexpected_retries=-1), "checks.3.max_unexpected_retries"),
    (lambda d: d["checks"][5]["tolerance"].update(core=-2), "checks.5.tolerance.core"),
    (
        lambda d: d["staleness"].update(required_fingerprints=["moon_phase"]),
        "staleness.required_fingerprints.0",
    ),
    (_del("checks", 4, "min_margin"), "checks.4.min_margin"),
    (_del("checks", 7), "checks.7"),
]


@pytest.mark.parametrize("edit, field", MALFORMED_POLICIES, ids=[m[1] for m in MALFORMED_POLICIES])
def test_malformed_policy_exits_2_naming_the_field(capsys, tmp_path, edit, field):
    policy = write_policy(tmp_path, edit)
    status, out, err = run(capsys, str(EXAMPLES / "candidate-a.json"), "--policy-path", policy)
    assert status == 2 and out == ""
    assert field in err, err


def test_unknown_fingerprint_name_exits_2(capsys, tmp_path):
    current = tmp_path / "now.json"
    current.write_text(json.dumps({"moon_phase": "full"}))
    status, _, err = run(capsys, str(EXAMPLES / "candidate-a.json"), "--fingerprints", str(current))
    assert status == 2 and "moon_phase" in err


def test_installed_command_runs_as_a_subprocess():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_dagster.cli",
            "gate",
            "evaluate",
            str(EXAMPLES / "candidate-b.json"),
            "--roles-path",
            ROLES,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LD_PIPELINE_PUBLIC_KEY": PIPELINE_PUB},  # the key from the environment
    )
    assert proc.returncode == 1, proc.stderr
    doc = json.loads(proc.stdout)
    assert [c["id"] for c in doc["checks"] if c["status"] != "pass"] == [2, 3]


def test_the_gate_imports_no_torch_dagster_or_mlflow():
    code = (
        "import sys, lightning_dagster.gate, lightning_dagster.gate.cli;"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'dagster', 'mlflow', 'sqlalchemy'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_an_approval_without_roles_or_by_an_unknown_actor_holds_on_check_7(capsys, tmp_path):
    status, out, _ = run(capsys, str(EXAMPLES / "candidate-a.json"), "--json")
    check7 = json.loads(out)["checks"][6]
    assert status == 1 and check7["status"] == "fail" and "no approvers were given" in check7["reason"]
    data = set_path(raw("a"), "approvals.0.actor", "mallory")
    status, out, _ = run(capsys, write_receipt(tmp_path, data), "--roles-path", ROLES, "--json")
    doc = json.loads(out)
    # the edit also broke the pipeline's attestation: never a promotion, whatever the checks say
    assert status == 3 and doc["verdict"] == "UNATTESTED"
    assert [c["id"] for c in doc["checks"] if c["status"] != "pass"] == [7]
    assert "actor 'mallory' is not among the deployment's approvers" in doc["checks"][6]["reason"]


def test_a_roles_file_that_cannot_be_read_exits_2(capsys, tmp_path):
    status, out, err = run(
        capsys, str(EXAMPLES / "candidate-a.json"), "--roles-path", str(tmp_path / "no.yaml")
    )
    assert status == 2 and out == "" and "roles" in err and err.count("\n") == 1


def one_line_exit_2(capsys, path: str) -> str:
    status, out, err = run(capsys, path)
    assert status == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_undecodable_too_deep_and_too_large_receipts_exit_2_in_one_line(capsys, tmp_path, monkeypatch):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b'{"receipt_id": "\xff\xfe"}')
    assert "not UTF-8" in one_line_exit_2(capsys, str(binary))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in one_line_exit_2(capsys, str(deep))
    # a depth JSON accepts but validation cannot walk: an algorithm setting nested 900 levels
    nested = set_path(raw("a"), "plan.algorithm.lr", "__X__")
    text = json.dumps(nested).replace('"__X__"', "[" * 900 + "]" * 900)
    assert "nested too deeply" in one_line_exit_2(capsys, write_receipt(tmp_path, None, text))
    from lightning_dagster.gate import receipt_models

    monkeypatch.setattr(receipt_models, "MAX_JSON_BYTES", 1000)
    assert "more than the limit of 1000" in one_line_exit_2(capsys, str(EXAMPLES / "candidate-a.json"))


def test_verify_on_a_store_that_is_not_a_database_exits_2_in_one_line(capsys, tmp_path):
    garbage = tmp_path / "store.db"
    garbage.write_bytes(bytes(range(256)) * 20)
    status = main(["gate", "verify", "r-1", "--store-url", f"sqlite:///{garbage}"])
    out, err = capsys.readouterr()
    assert status == 2 and out == "" and err.count("\n") == 1 and "not a database" in err, err


def test_an_undecodable_or_too_deep_policy_exits_2_in_one_line(capsys, tmp_path):
    for name, body in (("binary.yaml", b"version: \xff\xfe\n"), ("deep.yaml", b"[" * 100_000)):
        path = tmp_path / name
        path.write_bytes(body)
        status, out, err = run(capsys, str(EXAMPLES / "candidate-a.json"), "--policy-path", str(path))
        assert status == 2 and out == "" and err.count("\n") == 1 and "invalid policy" in err, err


@pytest.mark.parametrize("skew", ["nan", "-1", "inf"])
def test_a_clock_skew_that_is_not_a_finite_non_negative_number_is_refused(capsys, skew):
    with pytest.raises(SystemExit) as exit_:
        run(capsys, str(EXAMPLES / "candidate-a.json"), f"--clock-skew={skew}")
    assert exit_.value.code == 2 and "finite number of seconds" in capsys.readouterr().err
