"""Approvals prove who approved: only a signature by a pinned actor's key, over this receipt's evidence and
the step it approves, moves `approved-default`; a caller's own roles file or key authorizes no one."""

from __future__ import annotations

import argparse
import base64
import json
import os
import stat

import pytest

from lightning_dagster.canonical import canonical_json
from lightning_dagster.gate import ReceiptLedger
from lightning_dagster.gate.receipt import Approval, add_approval
from lightning_dagster.registry import Registry
from lightning_dagster.release import promotion, receipts
from lightning_dagster.release.cli import register
from lightning_dagster.release.errors import (
    ApprovalRefused,
    KeyFileError,
    NotAuthorized,
    PromotionRefused,
    RolesConfigError,
)
from lightning_dagster.release.receipts import sign_approval
from lightning_dagster.release.roles import (
    pin_fields,
    pin_roles,
    pin_state,
    pinned_roles,
    read_roles_file,
    registry_roles,
)
from lightning_dagster.release.signing import (
    ROLES_PIN,
    generate_keypair,
    load_private_key,
    public_key_line,
    sign,
)
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt, record_as_pipeline

SQLITE = pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)


def _setup(registry, variant, keys, receipt_id: str = "rec-signed"):
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    receipt = passing_receipt(registry, parent, cand, receipt_id, keys)
    (canary,) = receipt.approvals
    record_as_pipeline(registry, receipt.model_copy(update={"approvals": []}))
    receipts.approve(registry, receipt_id, canary)
    return parent, cand, receipt


def _forged_roles(tmp_path, mallory_key) -> str:
    """A caller's own roles file: mallory's public key under alice's name, with every role."""
    path = tmp_path / "my-roles.yaml"
    line = public_key_line(load_private_key(mallory_key))
    path.write_text(
        f"actors:\n  alice:\n    roles: [release-owner, default-approver, roles-admin]\n    key: {line}\n"
    )
    return str(path)


@SQLITE
def test_a_self_written_roles_file_authorizes_no_one(
    registry, variant, approver_keys, tracking, store_url, tmp_path, capsys, monkeypatch
):
    parent, cand, receipt = _setup(registry, variant, approver_keys)
    forged = _forged_roles(tmp_path, approver_keys["mallory"])
    as_alice = sign_approval(receipt, actor="alice", role="release-owner", key=approver_keys["mallory"])

    # The API with the caller's roles file: refused, naming the deployment's pin.
    mine = Registry(tracking.uri, registry.store, registry.model_name, roles_file=forged)
    with pytest.raises(RolesConfigError, match="not the deployment's pinned roles"):
        receipts.approve(mine, "rec-signed", as_alice)
    with pytest.raises(RolesConfigError, match="not the deployment's pinned roles"):
        promotion.promote(mine, "rec-signed", "alice", key=approver_keys["alice"])

    # The command with LD_ROLES_FILE pointing at it: read, and refused loudly, naming both hashes.
    monkeypatch.setenv("LD_ROLES_FILE", forged)
    common = ["--tracking-uri", tracking.uri, "--store-url", store_url, "--model-name", registry.model_name]
    argv = ["promote", "rec-signed", "--actor", "alice", "--key", str(approver_keys["mallory"]), *common]
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(argv)
    assert args.handler(args) == 1
    err = capsys.readouterr().err
    assert "not the deployment's pinned roles" in err and read_roles_file(forged).digest in err, err

    # Nor can the caller re-pin the roles: that needs the configured roles-admin key's signature.
    with pytest.raises(NotAuthorized, match="roles-admin"):
        pin_roles(registry.store, read_roles_file(forged), registry.gate)
    assert pinned_roles(registry.store, registry.gate).digest == read_roles_file(registry.roles_file).digest
    assert [m.to_value for m in registry.history()] == [parent.version]


@SQLITE
def test_every_approval_that_proves_nothing_is_refused_and_the_pointer_stays(
    registry, variant, approver_keys
):
    keys = approver_keys
    parent, cand, receipt = _setup(registry, variant, keys)
    other = passing_receipt(registry, parent, cand, "rec-other", keys)
    good = sign_approval(receipt, actor="alice", role="release-owner", key=keys["alice"], step="default")
    by_bob = sign_approval(receipt, actor="alice", role="release-owner", key=keys["bob"], step="default")
    by_mallory = sign_approval(receipt, actor="mallory", role="release-owner", key=keys["mallory"])
    over_other = sign_approval(other, actor="alice", role="release-owner", key=keys["alice"], step="default")
    canary = sign_approval(receipt, actor="alice", role="release-owner", key=keys["alice"], step="canary")
    attempts = {
        "not signed": good.model_copy(update={"signature": None, "evidence_hash": None}),
        "does not verify with alice's key": by_bob,
        "not among the deployment's approvers": by_mallory,
        "not this receipt's": over_other,
        "does not verify": canary.model_copy(update={"step": "default"}),  # signed for another step
        "does not verify ": good.model_copy(update={"at": good.at + 1}),  # a changed time
    }
    for reason, approval in attempts.items():
        with pytest.raises(ApprovalRefused, match=reason.strip()):
            receipts.approve(registry, "rec-signed", approval)
    # The signed approval of the canary step is valid, but it does not approve the default step.
    receipts.approve(registry, "rec-signed", canary)
    with pytest.raises(NotAuthorized, match="no signed default-step approval") as refused:
        promotion.promote(registry, "rec-signed", "alice", key=approver_keys["alice"])
    # The real reason in one line: alice holds her role; what the receipt lacks is her signed approval.
    message = str(refused.value)
    assert "does not hold role" not in message and "'alice'" in message and "\n" not in message

    # An unsigned approval written into the ledger around the registry is caught at promotion.
    ledger = ReceiptLedger(registry.store)
    head = ledger.head("rec-signed")
    ledger.append(add_approval(head, Approval(actor="alice", role="release-owner", step="default", at=1.0)))
    # The gate's check 7 (verifying signatures too) or the registry's own check refuses it, whichever first.
    with pytest.raises((ApprovalRefused, PromotionRefused), match="not signed"):
        promotion.promote(registry, "rec-signed", "alice", key=approver_keys["alice"])
    assert [m.to_value for m in registry.history()] == [parent.version]


@SQLITE
def test_an_ingested_receipt_with_an_unsigned_approval_is_refused_and_not_stored(
    registry, variant, approver_keys
):
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    receipt = passing_receipt(registry, parent, cand, "rec-ingest", approver_keys)
    unsigned = receipt.approvals[0].model_copy(update={"signature": None})
    forged = receipt.model_copy(update={"approvals": [unsigned]})
    default = sign_approval(forged, actor="alice", role="release-owner", key=approver_keys["alice"])
    with pytest.raises(ApprovalRefused, match="not signed"):
        receipts.approve(registry, forged, default)
    assert ReceiptLedger(registry.store).history("rec-ingest") == []


@SQLITE
def test_a_correctly_signed_approval_promotes(registry, variant, approver_keys):
    parent, cand, _ = _setup(registry, variant, approver_keys)
    stored = approve(registry, "rec-signed", approver_keys, "alice")
    assert [a.step for a in stored.receipt.approvals] == ["canary", "default"]
    result = promotion.promote(registry, "rec-signed", "alice", key=approver_keys["alice"])
    assert result.move.to_value == cand.version and result.move.actor == "alice"


@SQLITE
def test_roles_change_only_with_a_roles_admin_signature(registry, approver_keys, deployment_keys, tmp_path):
    deployed = registry_roles(registry)
    text = read_roles_file(registry.roles_file)
    new = tmp_path / "roles-v2.yaml"
    new.write_text(
        "actors:\n"
        + "".join(
            f"  {a}:\n    roles: [{', '.join(sorted(k.roles))}]\n    key: {k.public_key}\n"
            for a, k in text.actors.items()
            if a != "bob"
        )
    )
    changed = read_roles_file(new)
    assert pin_state(registry.store) == (deployed.digest, 1)
    fields = pin_fields(deployed.digest, changed.digest, pin_seq=1)
    # bob, and alice (a roles-admin of the pinned roles: a key the store holds), sign nothing that counts.
    for actor in ("bob", "alice"):
        wrong = sign(load_private_key(approver_keys[actor]), ROLES_PIN, fields)
        with pytest.raises(NotAuthorized):
            pin_roles(registry.store, changed, registry.gate, signature=wrong)
    right = sign(load_private_key(deployment_keys["roles-admin"]), ROLES_PIN, fields)
    pin_roles(registry.store, changed, registry.gate, signature=right)
    assert "bob" not in pinned_roles(registry.store, registry.gate, match_configured=False).actors
    with pytest.raises(RolesConfigError, match="not the deployment's pinned roles"):
        registry_roles(registry)  # the old file no longer matches the pin


@SQLITE
def test_a_roles_signature_is_not_replayed_after_the_pin_moved_back(registry, deployment_keys, tmp_path):
    """Pins A -> B -> A: the signature that moved A to B names pin move 1 and does not verify at move 3."""
    a = registry_roles(registry)
    alice = load_private_key(deployment_keys["roles-admin"])  # the configured roles-admin key
    new = tmp_path / "roles-b.yaml"
    new.write_text(
        "actors:\n"
        + "".join(
            f"  {n}:\n    roles: [{', '.join(sorted(k.roles))}]\n    key: {k.public_key}\n"
            for n, k in a.actors.items()
            if n != "bob"
        )
    )
    b = read_roles_file(new)
    to_b = sign(alice, ROLES_PIN, pin_fields(a.digest, b.digest, pin_seq=1))
    pin_roles(registry.store, b, registry.gate, signature=to_b)
    pin_roles(
        registry.store,
        a,
        registry.gate,
        signature=sign(alice, ROLES_PIN, pin_fields(b.digest, a.digest, pin_seq=2)),
    )
    assert pin_state(registry.store) == (a.digest, 3)
    with pytest.raises(NotAuthorized, match="move 3"):
        pin_roles(registry.store, b, registry.gate, signature=to_b)  # the replay
    assert pinned_roles(registry.store, registry.gate).digest == a.digest
    # Signatures in the formats before the one signed-message format verify no more: pin v1 (over the two
    # hashes only) and pin v2 (the hashes and the move number, each the canonical JSON of its own dict).
    for old in (
        {"purpose": "lightning-dagster roles pin v1", "from": a.digest, "to": b.digest},
        {"purpose": "lightning-dagster roles pin v2", "from": a.digest, "to": b.digest, "pin_seq": 3},
    ):
        signature = base64.b64encode(alice.sign(canonical_json(old))).decode()
        with pytest.raises(NotAuthorized):
            pin_roles(registry.store, b, registry.gate, signature=signature)
    # Signed over the pin as it stands, the same change is accepted.
    pin_roles(
        registry.store,
        b,
        registry.gate,
        signature=sign(alice, ROLES_PIN, pin_fields(a.digest, b.digest, pin_seq=3)),
    )
    assert pin_state(registry.store) == (b.digest, 4)
    assert [m.actor for m in registry.store.pointer_history("approval-roles")] == [
        "deployment",
        "roles-admin",
        "roles-admin",
        "roles-admin",
    ]


def test_keygen_writes_an_owner_only_key_and_prints_the_public_line(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["keygen", "--actor", "carol", "--out", str(tmp_path / "k"), "--json"])
    assert args.handler(args) == 0
    data = json.loads(capsys.readouterr().out)
    key = tmp_path / "k" / "carol.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert data["public_key"] == public_key_line(load_private_key(key))
    assert (tmp_path / "k" / "carol.pub").read_text().strip() == data["public_key"]
    with pytest.raises(KeyFileError, match="never overwritten"):
        generate_keypair("carol", tmp_path / "k")
    os.chmod(key, 0o644)
    with pytest.raises(KeyFileError, match="readable by others"):
        load_private_key(key)


@SQLITE
def test_the_roles_command_signs_over_the_pin_as_it_stands(
    registry, deployment_keys, tracking, store_url, tmp_path, capsys
):
    a = registry_roles(registry)
    new = tmp_path / "roles-c.yaml"
    new.write_text(
        "actors:\n"
        + "".join(
            f"  {n}:\n    roles: [{', '.join(sorted(k.roles))}]\n    key: {k.public_key}\n"
            for n, k in a.actors.items()
            if n != "racer0"
        )
    )
    parser = argparse.ArgumentParser()
    register(parser)
    common = ["--tracking-uri", tracking.uri, "--store-url", store_url, "--model-name", registry.model_name]
    pin = ["roles", *common, "--pin", str(new), "--key", str(deployment_keys["roles-admin"])]
    args = parser.parse_args(pin + ["--json"])
    assert args.handler(args) == 0
    assert json.loads(capsys.readouterr().out)["digest"] == read_roles_file(new).digest
    assert pin_state(registry.store) == (read_roles_file(new).digest, 2)
