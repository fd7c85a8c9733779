"""A receipt is an attestation: the fixture's receipts, signed by its pipeline key, keep their verdicts under
`gate evaluate` with that key; any edit of a signed receipt file (a value, an id, a list, a section from
another receipt, the attestation itself, another key's or another receipt's signature) is never promoted;
and a re-serialization that keeps the content keeps the verdict."""

from __future__ import annotations

import copy
import json
import random
import unicodedata
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_dagster.cli import main
from lightning_dagster.gate.attestation import PipelineKeys, split_file
from lightning_dagster.gate.checks import HOLD, PROMOTE, UNATTESTED
from lightning_dagster.gate.cli import judge
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.ledger import ReceiptLedger
from lightning_dagster.gate.receipt import parse_receipt
from lightning_dagster.release.signing import public_key_line
from lightning_dagster.store import Store
from tests.gate.conftest import EXAMPLES, PIPELINE_PUB, attested, raw, set_path
from tests.gate.test_receipt_rules import NOW, ROLES
from tests.gate.test_receipt_rules_cases import _serialized

FIXTURE = {"a": set(), "b": {2, 3}, "c": {5}, "d": {1, 6, 7}}
SECTIONS = ["plan", "fingerprints", "rollouts", "candidate", "holdout", "protected", "canary"]
SECTIONS += ["rollback_drill", "approvals", "receipt_id"]
OTHER_KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
MAKE = None


def make_fixtures() -> dict[str, Any]:
    global MAKE
    if MAKE is None:
        import runpy

        MAKE = runpy.run_path(str(EXAMPLES / "make_fixtures.py"))
    return MAKE


def outcome(data: Any, policy, public: str | None = PIPELINE_PUB) -> tuple[str, Any]:
    """What `gate evaluate` says of a receipt file's JSON (its own function, the clock fixed): `refused`
    and the invalid input, or the verdict and the evaluation."""
    try:
        ev = judge(data, policy, public, None, roles=ROLES, now=NOW)
    except InvalidInput as err:
        return "refused", err
    return ev.verdict, ev


@pytest.mark.parametrize("name", "abcd")
def test_the_signed_fixture_keeps_its_verdicts_through_the_cli(capsys, name):
    args = ["gate", "evaluate", str(EXAMPLES / f"candidate-{name}.json"), "--json"]
    args += ["--policy-path", str(EXAMPLES / "policy.yaml"), "--roles-path", str(EXAMPLES / "roles.yaml")]
    code = main([*args, "--pipeline-public-key", PIPELINE_PUB])
    doc = json.loads(capsys.readouterr().out)
    assert {c["id"] for c in doc["checks"] if c["status"] != "pass"} == FIXTURE[name]
    assert (code, doc["verdict"]) == ((0, PROMOTE) if name == "a" else (1, HOLD))
    # without the deployment's pipeline key nothing can be shown attested, so nothing promotes
    assert main(args) == 3
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == UNATTESTED and "no pipeline public key" in doc["hold_reasons"][0]


def test_an_edited_fixture_is_unattested(capsys, tmp_path):
    data = set_path(attested("c"), "protected.families.0.regressed", [])  # C's regressions deleted
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    args = ["gate", "evaluate", str(path), "--roles-path", str(EXAMPLES / "roles.yaml")]
    assert main([*args, "--pipeline-public-key", PIPELINE_PUB]) == 3
    out = capsys.readouterr().out
    assert "verdict: UNATTESTED" in out and "changed after the pipeline signed it" in out
    # an unsigned receipt, and one whose signature was made by another key
    del data["attestation"]
    path.write_text(json.dumps(data))
    assert main([*args, "--pipeline-public-key", PIPELINE_PUB]) == 3
    assert "not attested: it carries no pipeline signature" in capsys.readouterr().out
    assert main([*args, "--pipeline-public-key", "ed25519:AAAA"]) == 2  # a malformed key is bad input
    assert "pipeline_public_key" in capsys.readouterr().err


def test_an_exported_ledger_version_carries_its_attestation(tmp_path, capsys, policy):
    key = Ed25519PrivateKey.generate()
    store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    receipt = parse_receipt(raw("a"))
    ReceiptLedger(store, PipelineKeys(key, public_key_line(key))).append(receipt)
    assert main(["gate", "export", receipt.receipt_id, "--store-url", store.url]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert outcome(exported, policy, public_key_line(key))[0] == PROMOTE
    assert outcome(exported, policy, PIPELINE_PUB)[0] == UNATTESTED  # another deployment's key
    set_path(exported, "canary.usage.cost", 0.85)
    assert outcome(exported, policy, public_key_line(key))[0] == UNATTESTED


# ---------------------------------------------------------------- generated edits of signed files


def _leaves(node: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{path}.{k}" if path else k)]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, f"{path}.{i}")] or [(path, node)]
    return [(path, node)]


def _containers(node: Any, path: str = "", kind: type = list) -> list[str]:
    found = [path] if isinstance(node, kind) and path else []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for k, v in children:
        found += _containers(v, f"{path}.{k}" if path else str(k), kind)
    return found


def _get(data: Any, path: str) -> Any:
    for key in path.split("."):
        data = data[int(key)] if isinstance(data, list) else data[key]
    return data


def _other_value(value: Any, rng: random.Random) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + rng.choice([-1, 1, 7])
    if isinstance(value, float):
        return rng.choice([value + 0.01, value * 2 + 1, -value - 1, 0.0 if value else 1.0])
    if isinstance(value, str):
        return rng.choice([value + "x", value[:-1], value.upper() + "-2", ""])
    if value is None:
        return rng.choice([0, 1.0, "x", True])
    return None  # an empty list


def _change_a_value(data: dict, rng: random.Random) -> None:
    path, value = rng.choice(_leaves({k: v for k, v in data.items() if k != "attestation"}))
    set_path(data, path, _other_value(value, rng))


def _look_alike(data: dict, rng: random.Random) -> None:
    strings = [(p, v) for p, v in _leaves({k: v for k, v in data.items() if k != "attestation"})]
    path, value = rng.choice([(p, v) for p, v in strings if isinstance(v, str) and v])
    k = rng.randrange(len(value) + 1)
    edits = [
        value[:k] + rng.choice(["\u200b", "\u2060", "\ufeff", "\u00ad"]) + value[k:],
        value + rng.choice([" ", "\t", "\u00a0"]),
        " " + value,
        unicodedata.normalize("NFD", value + "é"),
        value[:k] + value[k:].swapcase(),
    ]
    set_path(data, path, rng.choice(edits))


def _duplicate_or_delete(data: dict, rng: random.Random) -> None:
    lists = [p for p in _containers({k: v for k, v in data.items() if k != "attestation"}) if _get(data, p)]
    items = _get(data, rng.choice(lists))
    i = rng.randrange(len(items))
    if rng.random() < 0.5:
        items.insert(rng.randrange(len(items) + 1), copy.deepcopy(items[i]))
    else:
        del items[i]


def _swap_section(data: dict, rng: random.Random) -> None:
    other = attested(rng.choice("abcd"))
    for section in rng.sample(SECTIONS, rng.randint(1, 3)):
        data[section] = other[section]


def _resign_with_another_key(data: dict, rng: random.Random) -> None:
    _change_a_value(data, rng) if rng.random() < 0.5 else None
    body, _ = split_file(data)
    data["attestation"] = make_fixtures()["attested"](parse_receipt(body), OTHER_KEY)["attestation"]


def _copy_another_attestation(data: dict, rng: random.Random) -> None:
    data["attestation"] = attested(rng.choice([n for n in "abcd" if attested(n) != data]))["attestation"]


def _edit_the_attestation(data: dict, rng: random.Random) -> None:
    if "attestation" not in data:
        raise IndexError("no attestation left to edit")
    att = data["attestation"]
    field = rng.choice(["version", "previous_hash", "at", "signature", "drop"])
    if field == "drop":
        del data["attestation"]
    elif field == "signature":
        raw_sig = bytearray(att["signature"].encode())
        raw_sig[rng.randrange(len(raw_sig) - 2)] ^= 1
        att["signature"] = raw_sig.decode(errors="replace")
    elif field == "previous_hash":
        att["previous_hash"] = "sha256:" + "0" * 64
    else:
        att[field] = _other_value(att[field], rng)


def _resign_the_approval(data: dict, rng: random.Random) -> None:
    """An approver (not the pipeline) signs the edited evidence again: the pipeline's signature still fails."""
    _change_a_value(data, rng)
    from tests.gate.conftest import resign_approval

    body, att = split_file(data)
    try:
        resign_approval(body, 0)
    except (InvalidInput, IndexError, KeyError, TypeError):
        return
    data.clear()
    data.update(body, attestation=att.model_dump(mode="json") if att else None)
    if att is None:
        del data["attestation"]


EDITS = [
    _change_a_value,
    _look_alike,
    _duplicate_or_delete,
    _swap_section,
    _resign_with_another_key,
    _copy_another_attestation,
    _edit_the_attestation,
    _resign_the_approval,
]
SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _content(data: Any) -> Any:
    """What a file says, as the gate reads it (None: not a receipt at all)."""
    try:
        body, att = split_file(data)
        return parse_receipt(body).to_json_dict(), att
    except (InvalidInput, ValueError, TypeError):
        return None


@SETTINGS
@given(
    st.sampled_from("abcd"), st.lists(st.sampled_from(EDITS), min_size=1, max_size=3), st.integers(0, 2**32)
)
def test_no_edited_signed_receipt_is_promoted(policy, name, edits, seed):
    data, rng = attested(name), random.Random(seed)
    for edit in edits:
        try:
            edit(data, rng)
        except (IndexError, ValueError):
            assume(False)  # nothing of that kind to edit here
    assume(_content(data) != _content(attested(name)))  # an edit that changed nothing is no edit
    verdict, found = outcome(data, policy)
    assert verdict != PROMOTE, (edits, found.hold_reasons)
    assert verdict in ("refused", UNATTESTED), (edits, verdict)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from("abcd"), st.integers(0, 2**64))
def test_a_re_serialized_signed_receipt_keeps_its_verdict(policy, tmp_path, name, seed):
    data = attested(name)
    path = tmp_path / f"{name}.json"
    path.write_text(_serialized(data, random.Random(seed)))
    from lightning_dagster.gate.receipt import read_json

    again = read_json(path, "receipt")
    assert again == data  # the same JSON value, written differently
    before, after = outcome(data, policy)[1], outcome(again, policy)[1]
    assert [(c.id, c.status) for c in after.checks] == [(c.id, c.status) for c in before.checks]
    assert after.verdict == before.verdict == (PROMOTE if name == "a" else HOLD)
    assert {c.id for c in after.checks if c.status != "pass"} == FIXTURE[name]
