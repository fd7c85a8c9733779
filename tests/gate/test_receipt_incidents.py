"""A verifying read that finds a receipt's chain broken records the break once as a receipt incident (in the
store's append-only documents), however many reads find it and however many find it at the same moment; a
chain that verifies records nothing. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.gate.attestation import PipelineKeys
from lightning_dagster.gate.errors import TamperedReceipt
from lightning_dagster.gate.ledger import ReceiptLedger, version_hash
from lightning_dagster.gate.receipt import Approval, add_approval
from lightning_dagster.gate.receipt_incidents import COLLECTION, incidents
from lightning_dagster.release.signing import public_key_line
from lightning_dagster.store import Store
from tests.gate.conftest import set_path
from tests.gate.test_ledger import _no_mlflow, _phases, _tamper

RID = "res-cand-a"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store_url(request, tmp_path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("postgres_url")
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def keys() -> PipelineKeys:
    key = Ed25519PrivateKey.generate()
    return PipelineKeys(key, public_key_line(key))


def _written(store_url, keys, receipt_a) -> Store:
    store = Store(store_url)
    for r in _phases(receipt_a):
        ReceiptLedger(store, keys).append(r)
    return store


def _rewrite_head(store) -> int:
    """Version 3 rewritten with its hash recomputed: only its attestation tells."""
    v3 = store.document_versions("receipts", RID)[2]
    forged = set_path(dict(v3.body), "approvals.1.role", "release-owner")
    _tamper(store, 3, body=forged, content_hash=version_hash(forged, v3.previous_hash))
    return v3.version


def test_a_chain_that_verifies_records_nothing(store_url, keys, receipt_a):
    store = _written(store_url, keys, receipt_a)
    ledger = ReceiptLedger(store, keys)
    assert ledger.head(RID) == _phases(receipt_a)[-1]
    ledger.append(add_approval(_phases(receipt_a)[-1], Approval(actor="c", role="r", step="canary", at=2.0)))
    report = ledger.verify_chain(RID, expected_head="sha256:" + "0" * 64)
    assert not report.ok and report.first_bad is None  # a head another record disagrees with: not the chain's
    assert ledger.record_break(report, "test") is None
    assert ledger.record_break(ledger.verify_chain("res-none"), "test") is None  # no receipt: no break
    assert store.document_versions(COLLECTION, RID) == [] and incidents(store, RID) == []


def test_a_break_is_recorded_once_however_many_reads_find_it(store_url, keys, receipt_a):
    store = _written(store_url, keys, receipt_a)
    version = _rewrite_head(store)
    ledger = ReceiptLedger(store, keys)
    problem = ledger.verify_chain(RID).problems[0]
    assert problem.startswith(f"version {version}: attestation of version {version} does not verify")
    with pytest.raises(TamperedReceipt, match=r"\(recorded as receipt incident 1\)") as first:
        ledger.head(RID)
    for _ in range(3):  # reads, an amendment, another process's ledger: the same incident
        with pytest.raises(TamperedReceipt, match=r"\(already recorded as receipt incident 1\)"):
            ReceiptLedger(Store(store_url), keys).head(RID)
    with pytest.raises(TamperedReceipt, match="already recorded as receipt incident 1"):
        ledger.append(
            add_approval(_phases(receipt_a)[-1], Approval(actor="c", role="r", step="canary", at=2.0))
        )
    (incident,) = incidents(store, RID)
    assert first.value.incident == incident
    assert (incident.number, incident.version, incident.problem, incident.reader) == (
        1,
        3,
        problem,
        "ledger read",
    )
    assert incident.head_hash == store.document_versions("receipts", RID)[-1].content_hash
    # the incidents chain like every document: each links to the one before
    assert store.document_versions(COLLECTION, RID)[0].previous_hash is None
    # A further break, earlier in the chain, is another incident: a reader without the key finds it too.
    v1 = store.document_versions("receipts", RID)[0]
    _tamper(store, 1, body=set_path(dict(v1.body), "plan.scope", "x"))
    with pytest.raises(TamperedReceipt, match="recorded as receipt incident 2"):
        ReceiptLedger(store, PipelineKeys()).head(RID)
    with pytest.raises(TamperedReceipt, match="already recorded as receipt incident 2"):
        ReceiptLedger(store, keys).head(RID)
    assert [(i.number, i.version) for i in incidents(store, RID)] == [(1, 3), (2, 1)]
    assert incidents(store, RID)[1].problem == f"version 1 body does not match its hash {v1.content_hash}"
    chain = store.document_versions(COLLECTION, RID)
    assert chain[1].previous_hash == chain[0].content_hash


class _Racing:
    """A store whose first read of the incidents waits for the other reader's: both find none recorded,
    both append, and one append loses the head."""

    def __init__(self, store: Store, barrier: threading.Barrier):
        self.store, self.barrier, self.waited = store, barrier, False

    def document_versions(self, collection: str, doc_id: str):
        found = self.store.document_versions(collection, doc_id)
        if collection == COLLECTION and not self.waited:
            self.waited = True
            self.barrier.wait()
        return found

    def append_document(self, *args, **kwargs):
        return self.store.append_document(*args, **kwargs)


def test_two_readers_finding_a_break_at_once_leave_one_incident(store_url, keys, receipt_a):
    store = _written(store_url, keys, receipt_a)
    _rewrite_head(store)
    barrier = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def read() -> None:
        try:
            ReceiptLedger(_Racing(Store(store_url), barrier), keys).head(RID)
        except BaseException as err:  # noqa: BLE001 - collected and checked below
            errors.append(err)

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 2 and all(isinstance(e, TamperedReceipt) for e in errors), errors
    assert sorted(str(e).rsplit("(", 1)[1] for e in errors) == [
        "already recorded as receipt incident 1)",
        "recorded as receipt incident 1)",
    ]
    assert {e.incident.number for e in errors} == {1}
    (incident,) = incidents(store, RID)
    assert incident.version == 3


def test_gate_verify_records_the_break_once_and_lists_the_incidents(
    store_url, keys, receipt_a, capsys, tmp_path, monkeypatch
):
    from lightning_dagster.cli import main

    monkeypatch.setenv("LD_PIPELINE_PUBLIC_KEY", keys.public)  # the deployment's key, also given by flag
    store = _written(store_url, keys, receipt_a)
    argv = ["gate", "verify", RID, "--store-url", store_url, "--tracking-uri", _no_mlflow(tmp_path)]
    argv += ["--pipeline-public-key", keys.public]
    assert main(argv) == 0 and "receipt incident" not in capsys.readouterr().out
    _rewrite_head(store)
    problem = ReceiptLedger(store, keys).verify_chain(RID).problems[0]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert f"receipt incident 1 (recorded now): {problem}" in out
    assert f"receipt incidents of {RID}:\n  - receipt incident 1 (" in out and "found by gate verify" in out
    assert main(argv) == 1
    assert f"receipt incident 1 (recorded before): {problem}" in capsys.readouterr().out
    (incident,) = incidents(store, RID)
    assert incident.reader == "gate verify" and incident.problem == problem


def test_gate_verify_with_a_key_that_is_not_the_deployments_records_no_incident(
    store_url, keys, receipt_a, capsys, tmp_path, monkeypatch
):
    """A caller's wrong `--pipeline-public-key` fails the attestations, but says nothing about the store."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from lightning_dagster.cli import main
    from lightning_dagster.release.signing import public_key_line

    monkeypatch.setenv("LD_PIPELINE_PUBLIC_KEY", keys.public)
    store = _written(store_url, keys, receipt_a)
    other = public_key_line(Ed25519PrivateKey.generate())
    argv = ["gate", "verify", RID, "--store-url", store_url, "--tracking-uri", _no_mlflow(tmp_path)]
    assert main([*argv, "--pipeline-public-key", other]) == 1
    out = capsys.readouterr().out
    assert "does not verify" in out and "receipt incident" not in out
    assert incidents(store, RID) == []
    assert main(argv) == 0  # the deployment's key: intact, nothing recorded
    assert incidents(store, RID) == []
