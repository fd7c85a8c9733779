"""Fixtures for the gate: the reference receipts of examples/gate and the packaged policy."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.policy import Policy, load_policy
from lightning_dagster.gate.receipt import Receipt, parse_receipt

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "gate"


def resign_approval(data: dict[str, Any], index: int) -> None:
    """Sign approval `index` of a receipt dict again with the example key, as its actor would sign it now."""
    import runpy

    signed = runpy.run_path(str(EXAMPLES / "make_fixtures.py"))["signed"]
    a = data["approvals"][index]
    approval = signed(parse_receipt(data), actor=a["actor"], role=a["role"], step=a["step"], at=a["at"])
    data["approvals"][index] = approval.model_dump(mode="json")


def example_approvers():
    """The approvers the example receipts' signatures verify against (`examples/gate/roles.yaml`)."""
    from lightning_dagster.release.roles import read_roles_file

    return read_roles_file(EXAMPLES / "roles.yaml").actors


_FILES = {name: json.loads((EXAMPLES / f"candidate-{name}.json").read_text()) for name in "abcd"}
_RAW = {name: {k: v for k, v in data.items() if k != "attestation"} for name, data in _FILES.items()}
# The fixture's pipeline public key, which the receipt files' attestations verify with.
PIPELINE_PUB = (EXAMPLES / "pipeline.pub").read_text().strip()


def raw(name: str) -> dict[str, Any]:
    """A fresh deep copy of a fixture receipt's JSON (the receipt, without the file's attestation)."""
    return copy.deepcopy(_RAW[name])


def attested(name: str) -> dict[str, Any]:
    """A fresh deep copy of a fixture receipt file's JSON: the receipt and its pipeline attestation."""
    return copy.deepcopy(_FILES[name])


def set_path(data: Any, path: str, value: Any) -> Any:
    """Set `value` at a dotted path (`canary.tasks.3.verified`); returns `data`."""
    *head, last = path.split(".")
    node = data
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def get_path(data: Any, path: str) -> Any:
    node = data
    for key in path.split("."):
        node = node[int(key)] if isinstance(node, list) else node[key]
    return node


def with_threshold(policy: Policy, check: Check, **values: Any) -> Policy:
    """A copy of `policy` with thresholds of one check's section replaced."""
    changed = getattr(policy.checks, check.name).model_copy(update=values)
    return policy.model_copy(update={"checks": policy.checks.model_copy(update={check.name: changed})})


@pytest.fixture(scope="session")
def policy() -> Policy:
    return load_policy(EXAMPLES / "policy.yaml")


@pytest.fixture
def receipt_a() -> Receipt:
    return parse_receipt(raw("a"))
