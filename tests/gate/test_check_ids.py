"""Every place that names a check takes the name from `Check`; `run_check` is the verdict's own check."""

from __future__ import annotations

import json

import pytest

from lightning_dagster.cli import main
from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.checks import evaluate, run_check
from lightning_dagster.gate.policy import ChecksPolicy, load_policy
from lightning_dagster.gate.receipt import parse_receipt, with_gate_record
from lightning_dagster.gate.staleness import VOIDS, void_checks
from tests.gate.conftest import EXAMPLES, PIPELINE_PUB, raw

NAMES = [
    "pinned",
    "span_coverage",
    "retry_debt",
    "heldout_margin",
    "protected_cases",
    "canary_verified",
    "rollback_and_approval",
]


def test_checks_are_numbered_one_to_seven_with_the_stored_machine_names():
    assert [int(c) for c in Check] == list(range(1, 8))
    assert [c.name for c in Check] == NAMES
    assert len({c.title for c in Check}) == 7 and len({c.description for c in Check}) == 7
    # receipts, policies and the staleness marks store the number: a check prints as it
    assert f"{Check.heldout_margin}" == str(Check.heldout_margin) == "4"
    assert json.dumps({Check.canary_verified: [Check.pinned]}) == '{"6": [1]}'


def test_asset_checks_take_their_names_and_descriptions_from_the_enum():
    from lightning_dagster.orchestration.assets.gate_checks import GATE_CHECKS

    specs = [spec for definition in GATE_CHECKS for spec in definition.check_specs]
    assert [s.name for s in specs] == [c.name for c in Check]
    # each asset check's description starts with the check's own; the one judged on part of the evidence
    # there (span coverage: the first batch only) says so after it
    assert all(s.description.startswith(c.description) for s, c in zip(specs, Check, strict=True))
    assert "first batch only" in specs[Check.span_coverage - 1].description


def test_policy_sections_are_the_checks_numbers_and_its_attributes_their_names():
    fields = ChecksPolicy.model_fields
    assert list(fields) == [c.name for c in Check]
    assert [f.alias for f in fields.values()] == [c.section for c in Check]
    dumped = load_policy().model_dump(mode="json", by_alias=True)["checks"]
    assert list(dumped) == [str(n) for n in range(1, 8)]


def test_unknown_policy_section_is_rejected_naming_the_known_numbers():
    from lightning_dagster.gate.errors import InvalidInput
    from lightning_dagster.gate.policy import parse_policy

    data = load_policy().model_dump(mode="json", by_alias=True)
    data["checks"]["heldout_margin"] = data["checks"].pop("4")
    with pytest.raises(InvalidInput) as err:
        parse_policy(data)
    assert err.value.fields == ["checks.heldout_margin"]


def test_cli_table_and_json_use_the_enum_titles_and_names(capsys):
    receipt, key = str(EXAMPLES / "candidate-d.json"), ["--pipeline-public-key", PIPELINE_PUB]
    assert main(["gate", "evaluate", receipt, *key]) == 1
    table = capsys.readouterr().out.splitlines()
    rows = table[table.index(next(line for line in table if line.startswith("#  check"))) + 1 :][:7]
    assert [row.split("  ")[0] for row in rows] == [str(c.value) for c in Check]
    assert all(c.title in row for c, row in zip(Check, rows, strict=True))
    assert "  - check 6 (bounded canary) fail: " in "\n".join(table)
    assert main(["gate", "evaluate", receipt, "--json", *key]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert [(c["id"], c["name"], c["title"]) for c in doc["checks"]] == [
        (c.value, c.name, c.title) for c in Check
    ]


def test_gate_record_keeps_checks_as_enum_members_stored_as_numbers(policy):
    receipt = parse_receipt(raw("d"))
    ev = evaluate(receipt, policy, {"serving_model": "sha256:another"})
    recorded = with_gate_record(receipt, ev.to_record()).gate
    assert recorded.failed_checks == [Check.pinned, Check.canary_verified, Check.rollback_and_approval]
    assert recorded.stale_checks == [Check.canary_verified]
    stored = with_gate_record(receipt, ev.to_record()).to_json_dict()["gate"]
    assert (stored["failed_checks"], stored["stale_checks"]) == ([1, 6, 7], [6])
    assert parse_receipt({**raw("d"), "gate": stored}).gate == recorded


def test_staleness_voids_name_checks_by_the_enum(receipt_a):
    assert all(isinstance(c, Check) for checks in VOIDS.values() for c in checks)
    void = void_checks(receipt_a.fingerprints, {"parent": "sha256:another"})
    assert list(void) == [Check.pinned, Check.heldout_margin, Check.rollback_and_approval]


@pytest.mark.parametrize("name", "abcd")
def test_run_check_gives_the_verdicts_entry_for_each_check(policy, name):
    receipt = parse_receipt(raw(name))
    ev = evaluate(receipt, policy)
    for check, entry in zip(Check, ev.checks, strict=True):
        assert entry.id is check
        assert run_check(check, receipt, policy) == entry
        assert run_check(int(check), receipt, policy) == entry


def test_run_check_rejects_an_unknown_check_number(receipt_a, policy):
    with pytest.raises(ValueError, match="8 is not a valid Check"):
        run_check(8, receipt_a, policy)
