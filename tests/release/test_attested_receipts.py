"""Receipts on a deployment with a pipeline key: every version the pipeline and the approvals write is
attested; a ledger head rewritten with its hash recomputed (as a database owner could) is refused by
promotion and by the pipeline's own read, `gate verify` names the version that disagrees with MLflow's
receipt tags and with its attestation, without being told the head, and the break is recorded once as a
receipt incident however many reads find it. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import re

import pytest

from lightning_dagster.gate.attestation import PipelineKeys
from lightning_dagster.gate.errors import TamperedReceipt
from lightning_dagster.gate.ledger import ReceiptLedger, use_keys, version_hash
from lightning_dagster.gate.receipt_incidents import incidents
from lightning_dagster.pipeline.context import find_receipt, receipt_id
from lightning_dagster.release import promotion
from lightning_dagster.release.pipeline_key import keys as pipeline_keys
from lightning_dagster.settings import gate_from_env
from tests.registry.helpers import approve, bootstrap, passing_receipt
from tests.registry.test_chain_tamper import _sql


def _rewrite_head(store, receipt_id: str) -> int:
    """Raise the head's held-out mean and store it with a recomputed hash, around the append-only triggers."""
    head = store.document_versions("receipts", receipt_id)[-1]
    body = json.loads(json.dumps(head.body))
    body["holdout"]["families"][0]["candidate_mean"] = 0.99
    value = "CAST(:b AS JSON)" if store.engine.dialect.name == "postgresql" else ":b"
    row = {
        "b": json.dumps(body),
        "h": version_hash(body, head.previous_hash),
        "d": receipt_id,
        "v": head.version,
    }
    _sql(
        store,
        (f"UPDATE documents SET body = {value}, content_hash = :h "
         "WHERE collection = 'receipts' AND doc_id = :d AND version = :v", row),
        unlock=("documents",),
    )  # fmt: skip
    return head.version


def test_a_rewritten_head_is_refused_and_named_by_every_record(
    registry, variant, tracking, approver_keys, capsys
):
    from lightning_dagster.cli import main

    # the deployment's pipeline key, as the code location and every command load it ($LD_PIPELINE_KEY)
    deployment = pipeline_keys(gate_from_env())
    use_keys(registry.store, deployment)
    public = deployment.public
    parent, (cand,) = bootstrap(registry, variant)
    rid = receipt_id("att")  # the pipeline's receipt of snapshot `att`
    approve(registry, passing_receipt(registry, parent, cand, rid, approver_keys), approver_keys, "alice")
    ledger = ReceiptLedger(registry.store)
    history = ledger.history(rid)
    assert len(history) == 2 and ledger.verify_chain(rid).ok
    assert sorted(ledger.attestations(rid)) == [1, 2]  # the pipeline's version and the approval's
    url = registry.store.engine.url.render_as_string(hide_password=False)
    verify = ["gate", "verify", rid, "--store-url", url, "--tracking-uri", tracking.uri]
    verify += ["--model-name", registry.model_name]
    assert main(verify) == 0  # the attestations and MLflow's receipt tags confirm the head
    out = capsys.readouterr().out
    assert "chain intact" in out and "receipt incident" not in out
    assert incidents(registry.store, rid) == []  # reading a chain that verifies records nothing

    version = _rewrite_head(registry.store, rid)
    assert ReceiptLedger(registry.store, PipelineKeys()).verify_chain(rid).ok  # the chain alone agrees
    broken = (
        f"version {version}: attestation of version {version} does not verify with the pipeline key {public}"
    )
    with pytest.raises(TamperedReceipt, match=re.escape(broken) + r".*\(recorded as receipt incident 1\)"):
        promotion.promote(registry, rid, "alice")
    assert [m.to_value for m in registry.history()] == [parent.version]
    # the pipeline's own read of the snapshot's receipt refuses it too
    with pytest.raises(TamperedReceipt, match=re.escape(broken) + ".*already recorded as receipt incident 1"):
        find_receipt(registry.store, "att")
    with pytest.raises(TamperedReceipt, match=re.escape(broken)):
        ReceiptLedger(registry.store).head(rid, verify=True)
    assert main(verify) == 1
    out = capsys.readouterr().out
    assert f"version {version} disagrees with MLflow's receipt tags on model version {cand.version}" in out
    assert f"  - {broken}" in out
    assert f"receipt incident 1 (recorded before): {broken}" in out
    assert main([*verify, "--pipeline-public-key", public]) == 1
    assert f"receipt incident 1 (recorded before): {broken}" in capsys.readouterr().out
    with pytest.raises(TamperedReceipt):
        promotion.promote(registry, rid, "alice")
    # One incident however many reads found the break, naming its first bad version.
    (incident,) = incidents(registry.store, rid)
    assert (incident.number, incident.version, incident.reader) == (1, version, "ledger read")
    assert incident.problem.startswith(broken)
