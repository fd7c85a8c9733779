"""Receipts on a deployment with a pipeline key: every version the pipeline and the approvals write is
attested; a ledger head rewritten with its hash recomputed (as a database owner could) is refused by
promotion, and `gate verify` names the version that disagrees with MLflow's receipt tags and with its
attestation, without being told the head."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from lightning_dagster.gate.attestation import PipelineKeys
from lightning_dagster.gate.errors import TamperedReceipt
from lightning_dagster.gate.ledger import ReceiptLedger, use_keys, version_hash
from lightning_dagster.release import promotion
from lightning_dagster.release.signing import public_key_line
from tests.registry.helpers import approve, bootstrap, passing_receipt


def _rewrite_head(store, receipt_id: str) -> int:
    """Raise the head's held-out mean and store it with a recomputed hash, around the append-only triggers."""
    head = store.document_versions("receipts", receipt_id)[-1]
    body = json.loads(json.dumps(head.body))
    body["holdout"]["families"][0]["candidate_mean"] = 0.99
    with store.engine.begin() as c:
        for (name,) in c.execute(
            sa.text("select name from sqlite_master where type = 'trigger' and tbl_name = 'documents'")
        ).fetchall():
            c.execute(sa.text(f"drop trigger {name}"))
        c.execute(
            sa.text(
                "update documents set body = :b, content_hash = :h "
                "where collection = 'receipts' and doc_id = :d and version = :v"
            ),
            {
                "b": json.dumps(body),
                "h": version_hash(body, head.previous_hash),
                "d": receipt_id,
                "v": head.version,
            },
        )
    return head.version


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_rewritten_head_is_refused_and_named_by_every_record(
    registry, variant, tracking, approver_keys, capsys
):
    from lightning_dagster.cli import main

    key = Ed25519PrivateKey.generate()
    public = public_key_line(key)
    use_keys(registry.store, PipelineKeys(key, public))
    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-att", approver_keys), approver_keys, "alice"
    )
    ledger = ReceiptLedger(registry.store)
    history = ledger.history("rec-att")
    assert len(history) == 2 and ledger.verify_chain("rec-att").ok
    assert sorted(ledger.attestations("rec-att")) == [1, 2]  # the pipeline's version and the approval's
    verify = ["gate", "verify", "rec-att", "--store-url", registry.store.url, "--tracking-uri", tracking.uri]
    verify += ["--model-name", registry.model_name]
    assert main(verify) == 0  # MLflow's receipt tags confirm the head
    assert "chain intact" in capsys.readouterr().out

    version = _rewrite_head(registry.store, "rec-att")
    assert ReceiptLedger(registry.store, PipelineKeys()).verify_chain("rec-att").ok  # the chain alone agrees
    with pytest.raises(TamperedReceipt, match=f"version {version}: attestation of version {version}"):
        promotion.promote(registry, "rec-att", "alice")
    assert [m.to_value for m in registry.history()] == [parent.version]
    assert main(verify) == 1
    out = capsys.readouterr().out
    assert f"version {version} disagrees with MLflow's receipt tags on model version {cand.version}" in out
    assert main([*verify, "--pipeline-public-key", public]) == 1
    assert f"version {version}: attestation of version {version} does not verify" in capsys.readouterr().out
