"""Receipts are content-hashed and appended to the real store's append-only documents (SQLite here);
amendments only add, and any edit of a stored body, hash or link is detected."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.gate.attestation import PipelineKeys
from lightning_dagster.gate.checks import evaluate
from lightning_dagster.gate.errors import AmendmentError, TamperedReceipt
from lightning_dagster.gate.ledger import ReceiptLedger, version_hash
from lightning_dagster.gate.receipt import Approval, Receipt, add_approval, from_plan, with_gate_record
from lightning_dagster.release.signing import public_key_line
from lightning_dagster.store import Store
from tests.gate.conftest import raw, set_path


@pytest.fixture
def store(tmp_path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'store.db'}")


def _phases(receipt_a: Receipt) -> list[Receipt]:
    """A's receipt as the pipeline would store it: plan, then all evidence, then a second approval."""
    plan_only = from_plan(receipt_a.plan, fingerprints=receipt_a.fingerprints)
    amended = add_approval(receipt_a, Approval(actor="bob", role="ml-lead", step="canary", at=1.0))
    return [plan_only, receipt_a, amended]


def _tamper(store: Store, version: int, *, body: dict | None = None, content_hash: str | None = None) -> None:
    """What an attacker with database access does: lift the append-only guard, then edit a row."""
    with store.engine.begin() as c:
        if store.engine.dialect.name == "postgresql":
            c.execute(sa.text("ALTER TABLE documents DISABLE TRIGGER documents_append_only"))
        else:
            c.execute(sa.text("DROP TRIGGER IF EXISTS documents_no_update"))
        values = {}
        if body is not None:
            values["body"] = json.dumps(body)
        if content_hash is not None:
            values["content_hash"] = content_hash
        sets = ", ".join(f"{k} = :{k}" for k in values)
        if store.engine.dialect.name == "postgresql":
            sets = sets.replace(":body", "CAST(:body AS JSON)")
        c.execute(
            sa.text(
                f"UPDATE documents SET {sets} WHERE collection = 'receipts' AND doc_id = :d AND version = :v"
            ),
            {**values, "d": "res-cand-a", "v": version},
        )


def test_amendments_chain_versions_and_verify(store, receipt_a):
    ledger = ReceiptLedger(store)
    entries = [ledger.append(r) for r in _phases(receipt_a)]
    assert [e.version for e in entries] == [1, 2, 3]
    assert entries[0].previous_hash is None
    assert [e.previous_hash for e in entries[1:]] == [e.content_hash for e in entries[:-1]]
    report = ledger.verify_chain("res-cand-a", expected_head=entries[-1].content_hash)
    assert report.ok and report.versions == 3, report.problems
    head = ledger.head("res-cand-a")
    assert [a.actor for a in head.approvals] == ["alice", "bob"]
    assert head == _phases(receipt_a)[-1]


def test_appending_the_same_receipt_twice_adds_no_version(store, receipt_a):
    ledger = ReceiptLedger(store)
    first = ledger.append(receipt_a)
    assert ledger.append(receipt_a) == first
    assert len(ledger.history("res-cand-a")) == 1


def test_the_gate_record_may_be_replaced_but_evidence_may_not(store, receipt_a, policy):
    ledger = ReceiptLedger(store)
    ledger.append(receipt_a)
    ev = evaluate(receipt_a, policy)
    ledger.append(with_gate_record(receipt_a, ev.to_record()))
    assert ledger.head("res-cand-a").gate.receipt_hash == ev.receipt_hash
    with pytest.raises(AmendmentError) as err:
        ledger.append(
            Receipt.model_validate(set_path(raw("a"), "plan.parent.uri", "models:/agent-policy/other"))
        )
    assert err.value.field == "plan.parent.uri"
    with pytest.raises(AmendmentError) as err:
        ledger.append(Receipt.model_validate(set_path(raw("a"), "approvals", [])))
    assert err.value.field == "approvals"
    with pytest.raises(AmendmentError) as err:
        ledger.append(Receipt.model_validate(set_path(raw("a"), "canary.tasks.4.verified", False)))
    assert err.value.field == "canary.tasks.4.verified"
    assert len(ledger.history("res-cand-a")) == 2


def test_the_store_refuses_a_plain_update(store, receipt_a):
    ReceiptLedger(store).append(receipt_a)
    with pytest.raises(sa.exc.DBAPIError), store.engine.begin() as c:
        c.execute(sa.text("UPDATE documents SET body = '{}'"))


def test_an_edited_stored_body_is_detected(store, receipt_a):
    ledger = ReceiptLedger(store)
    for r in _phases(receipt_a):
        ledger.append(r)
    forged = set_path(
        store.document_versions("receipts", "res-cand-a")[1].body, "holdout.families.0.candidate_mean", 0.99
    )
    _tamper(store, 2, body=forged)
    report = ledger.verify_chain("res-cand-a")
    assert not report.ok
    assert report.problems == [
        f"version 2 body does not match its hash {ledger.history('res-cand-a')[1].content_hash}"
    ]
    with pytest.raises(TamperedReceipt):
        ledger.head("res-cand-a")


def test_a_rewritten_body_with_a_recomputed_hash_breaks_the_next_link(store, receipt_a):
    ledger = ReceiptLedger(store)
    for r in _phases(receipt_a):
        ledger.append(r)
    v2 = store.document_versions("receipts", "res-cand-a")[1]
    forged = set_path(dict(v2.body), "canary.tasks.0.harmful_effect", True)
    _tamper(store, 2, body=forged, content_hash=version_hash(forged, v2.previous_hash))
    report = ledger.verify_chain("res-cand-a")
    assert not report.ok and any(p.startswith("version 3 links to") for p in report.problems)


def test_a_rewritten_head_is_caught_against_the_recorded_head_hash(store, receipt_a):
    ledger = ReceiptLedger(store)
    entries = [ledger.append(r) for r in _phases(receipt_a)]
    v3 = store.document_versions("receipts", "res-cand-a")[2]
    forged = set_path(dict(v3.body), "approvals.1.role", "release-owner")
    _tamper(store, 3, body=forged, content_hash=version_hash(forged, v3.previous_hash))
    assert ledger.verify_chain("res-cand-a").ok  # a consistent rewrite of the newest version...
    report = ledger.verify_chain("res-cand-a", expected_head=entries[-1].content_hash)
    assert not report.ok and "expected" in report.problems[0]  # ...is caught by the anchored head hash


def test_verify_command_reports_an_intact_and_a_tampered_chain(store, receipt_a, capsys, tmp_path):
    from lightning_dagster.cli import main

    key = Ed25519PrivateKey.generate()
    ledger = ReceiptLedger(store, PipelineKeys(key, public_key_line(key)))
    for r in _phases(receipt_a):
        ledger.append(r)
    verify = [
        "gate",
        "verify",
        "res-cand-a",
        "--store-url",
        store.url,
        "--tracking-uri",
        _no_mlflow(tmp_path),
    ]
    # the chain alone confirms nothing: a rewrite that recomputes its hashes would pass it
    assert main(verify) == 1
    assert "no independent record confirms the head" in capsys.readouterr().out
    assert main([*verify, "--pipeline-public-key", public_key_line(key)]) == 0
    out = capsys.readouterr().out
    assert "3 versions" in out and "chain intact" in out and "attestations: verified" in out
    assert main(["gate", "verify", "res-cand-zzz", "--store-url", store.url]) == 2
    _tamper(
        store, 1, body=set_path(store.document_versions("receipts", "res-cand-a")[0].body, "plan.scope", "x")
    )
    assert main([*verify, "--pipeline-public-key", public_key_line(key)]) == 1
    assert "version 1 body does not match" in capsys.readouterr().out


def _no_mlflow(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_head_rewritten_with_its_hash_recomputed_fails_verify_by_its_attestation(
    store, receipt_a, capsys, tmp_path
):
    from lightning_dagster.cli import main

    key = Ed25519PrivateKey.generate()
    keys = PipelineKeys(key, public_key_line(key))
    entries = [ReceiptLedger(store, keys).append(r) for r in _phases(receipt_a)]
    assert all(e.attested for e in entries)
    v3 = store.document_versions("receipts", "res-cand-a")[2]
    forged = set_path(dict(v3.body), "approvals.1.role", "release-owner")
    _tamper(store, 3, body=forged, content_hash=version_hash(forged, v3.previous_hash))
    assert ReceiptLedger(store).verify_chain("res-cand-a").ok  # the hash chain alone is consistent
    report = ReceiptLedger(store, PipelineKeys(public=public_key_line(key))).verify_chain("res-cand-a")
    assert not report.ok and report.problems == [
        f"version 3: attestation of version 3 does not verify with the pipeline key {public_key_line(key)}: "
        "the receipt was changed after the pipeline signed it, or another key signed it"
    ]
    with pytest.raises(TamperedReceipt, match="version 3"):
        ReceiptLedger(store, keys).head("res-cand-a")
    with pytest.raises(TamperedReceipt, match="version 3"):  # nothing is attested on top of it
        ReceiptLedger(store, keys).append(
            add_approval(receipt_a, Approval(actor="c", role="r", step="canary", at=2.0))
        )
    argv = ["gate", "verify", "res-cand-a", "--store-url", store.url, "--tracking-uri", _no_mlflow(tmp_path)]
    assert main([*argv, "--pipeline-public-key", public_key_line(key)]) == 1
    assert "version 3: attestation of version 3 does not verify" in capsys.readouterr().out


def test_versions_the_pipeline_did_not_attest_fail_and_are_not_attested_over(store, receipt_a):
    key = Ed25519PrivateKey.generate()
    keys = PipelineKeys(key, public_key_line(key))
    phases = _phases(receipt_a)
    ReceiptLedger(store, keys).append(phases[0])
    ReceiptLedger(store).append(phases[1])  # written around the pipeline: no attestation
    report = ReceiptLedger(store, keys).verify_chain("res-cand-a")
    assert report.problems == ["version 2: not attested: it carries no pipeline signature"]
    with pytest.raises(TamperedReceipt, match="version 2: not attested"):
        ReceiptLedger(store, keys).append(phases[2])
    # another key's attestation of the same version is no attestation by this one
    other = Ed25519PrivateKey.generate()
    assert not ReceiptLedger(store, PipelineKeys(public=public_key_line(other))).verify_chain("res-cand-a").ok


@pytest.mark.postgres
def test_tampering_is_detected_on_postgresql(postgres_url, receipt_a):
    store = Store(postgres_url)
    ledger = ReceiptLedger(store)
    entries = [ledger.append(r) for r in _phases(receipt_a)]
    assert ledger.verify_chain("res-cand-a", expected_head=entries[-1].content_hash).ok
    assert ledger.head("res-cand-a") == _phases(receipt_a)[-1]  # the JSON column round-trips exactly
    forged = set_path(
        store.document_versions("receipts", "res-cand-a")[1].body, "canary.tasks.0.verified", False
    )
    _tamper(store, 2, body=forged)
    report = ledger.verify_chain("res-cand-a")
    assert not report.ok and report.problems[0].startswith("version 2 body does not match")
