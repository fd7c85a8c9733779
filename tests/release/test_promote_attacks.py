"""Promotion against a hostile registry: an artifact swapped behind a registered version, a receipt edited in
the ledger. Each is refused with its reason and `approved-default` stays where it was."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from lightning_dagster.gate.errors import TamperedReceipt
from lightning_dagster.release import promotion, receipts, rollbacks
from lightning_dagster.release.errors import NotAuthorized, PromotionRefused
from lightning_dagster.release.roles import registry_roles
from tests.registry.helpers import approve, artifact_files, bootstrap, passing_receipt, signed_rollback


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_candidate_whose_artifact_was_swapped_is_not_promoted(registry, variant, tracking, approver_keys):
    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-swap", approver_keys), approver_keys, "alice"
    )
    registry.download(cand.version)  # this host's cache holds the right bytes (as after the canary)
    (weights,) = artifact_files(tracking, cand.run_id, "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))  # the learner rewrites the registered artifact

    with pytest.raises(
        PromotionRefused, match=f"candidate version {cand.version}'s artifact is not the weights"
    ):
        promotion.promote(registry, "rec-swap", "alice", key=approver_keys["alice"])
    assert [m.to_value for m in registry.history()] == [parent.version]
    assert registry.serve_approved(download=False).version == parent.version


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_cli_promote_of_a_receipt_edited_in_the_ledger_is_refused_in_one_line(
    registry, variant, tracking, approver_keys, monkeypatch, capsys
):
    from lightning_dagster.cli import main

    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-edit", approver_keys), approver_keys, "alice"
    )
    store = registry.store
    with store.engine.begin() as c:  # around the store's append-only triggers, as a database owner could
        for (name,) in c.execute(
            sa.text("select name from sqlite_master where type = 'trigger' and tbl_name = 'documents'")
        ).fetchall():
            c.execute(sa.text(f"drop trigger {name}"))
        c.execute(
            sa.text(
                "update documents set body = json_set(body, '$.holdout.families[0].candidate_mean', 0.99) "
                "where collection = 'receipts' and doc_id = 'rec-edit' and version = 2"
            )
        )
    monkeypatch.setenv("LD_STORE_URL", store.url)
    argv = ["registry", "promote", "rec-edit", "--actor", "alice", "--tracking-uri", tracking.uri]
    assert main([*argv, "--model-name", registry.model_name]) == 1
    assert "version 2 body does not match its hash" in capsys.readouterr().err
    assert [m.to_value for m in registry.history()] == [parent.version]


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_rollback_in_a_role_that_may_not_move_the_pointer_is_refused(
    registry, variant, tracking, approver_keys, monkeypatch, capsys
):
    from lightning_dagster.cli import main

    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry,
        passing_receipt(registry, parent, cand, "rec-rb-role", approver_keys),
        approver_keys,
        "alice",
    )
    promotion.promote(registry, "rec-rb-role", "alice", key=approver_keys["alice"])
    # bob holds ml-lead only, alice also roles-admin: naming a role one holds is not leave to move the pointer.
    for actor, role in (("bob", "ml-lead"), ("alice", "roles-admin")):
        with pytest.raises(NotAuthorized, match="needs one of the roles"):
            rollbacks.rollback(
                registry, signed_rollback(registry, parent.version, actor, approver_keys, role=role)
            )
    monkeypatch.setenv("LD_STORE_URL", registry.store.url)
    argv = ["registry", "rollback", parent.version, "--actor", "bob", "--role", "ml-lead"]
    argv += ["--key", str(approver_keys["bob"]), "--reason", "regression"]
    assert main([*argv, "--tracking-uri", tracking.uri, "--model-name", registry.model_name]) == 1
    assert "needs one of the roles ['default-approver', 'release-owner']" in capsys.readouterr().err
    assert [m.to_value for m in registry.history()] == [parent.version, cand.version]


def _loose_policy(tmp_path) -> str:
    """A caller's own policy: any margin, any regressions, no canary verification."""
    import yaml

    from lightning_dagster.gate import load_policy

    data = load_policy().model_dump(mode="json", by_alias=True)
    data["version"] = "mine"
    data["checks"]["4"] |= {"min_margin": -1.0, "min_n": 0}
    data["checks"]["5"] |= {"default_tolerance": 1000}
    data["checks"]["6"] |= {"min_verified_share": 0.0}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _worse(data):
    """Held-out figures no better than the parent's, the canary unverified: the default policy holds it."""
    for family in data["holdout"]["families"]:
        family["candidate_mean"] = family["parent_mean"]
    data["canary"]["tasks"][0]["verified"] = False


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_cli_promote_of_a_receipt_written_by_hand_is_refused_whatever_it_claims(
    registry, variant, tracking, approver_keys, monkeypatch, capsys, tmp_path
):
    """A valid approver key and a receipt file of invented figures (held-out, protected, canary, coverage,
    retry debt) pointing at real versions: the pipeline never recorded that evidence, so nothing moves,
    under the packaged policy or a caller's own (with a gate record of its own naming it)."""
    import json

    from lightning_dagster.cli import main
    from lightning_dagster.gate import evaluate, load_policy
    from lightning_dagster.gate.receipt import with_gate_record

    parent, (cand,) = bootstrap(registry, variant)
    monkeypatch.setenv("LD_STORE_URL", registry.store.url)
    common = ["--tracking-uri", tracking.uri, "--model-name", registry.model_name]
    loose = _loose_policy(tmp_path)
    invented = passing_receipt(registry, parent, cand, "rcpt-invented", approver_keys)
    worse = passing_receipt(registry, parent, cand, "rcpt-loose", approver_keys, edit=_worse)
    judged = evaluate(worse, load_policy(loose), None, roles=registry_roles(registry).actors)
    assert judged.verdict == "PROMOTE TO BOUNDED CANARY"  # the caller's policy would pass it
    worse = with_gate_record(worse, judged.to_record())
    for receipt, policy in ((invented, []), (worse, ["--policy", loose])):
        path = tmp_path / f"{receipt.receipt_id}.json"
        path.write_text(json.dumps(receipt.to_json_dict()))
        key = ["--key", str(approver_keys["alice"])]
        argv = ["registry", "promote", str(path), "--actor", "alice", *key, *policy, *common]
        assert main(argv) == 1
        # the deployment attests its receipts (its pipeline key is configured): the file's is not attested
        err = capsys.readouterr().err
        assert "not attested: it carries no pipeline signature" in err or "not written by the pipeline" in err
        with pytest.raises(
            (PromotionRefused, TamperedReceipt), match="not written by the pipeline|not attested"
        ):
            promotion.promote(
                registry,
                receipt.receipt_id,
                "alice",
                key=approver_keys["alice"],
                policy=loose if policy else None,
            )
    assert [m.to_value for m in registry.history()] == [parent.version]


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_pipeline_receipt_is_judged_only_under_the_policy_its_gate_recorded(
    registry, variant, tracking, approver_keys, tmp_path
):
    """The pipeline's receipt before `release_receipt` judged it cannot be promoted under a caller's policy
    (nor any: it has no verdict); once judged, only under the policy of its gate record."""
    from lightning_dagster.gate.ledger import RECEIPT_SNAPSHOTS, ReceiptLedger
    from lightning_dagster.pipeline.context import save_doc
    from tests.registry.helpers import record_as_pipeline

    parent, (cand,) = bootstrap(registry, variant)
    loose = _loose_policy(tmp_path)
    unjudged = passing_receipt(registry, parent, cand, "rcpt-snap-unjudged", approver_keys, edit=_worse)
    save_doc(registry.store, RECEIPT_SNAPSHOTS, unjudged.receipt_id, {"snapshot_key": "snap-unjudged"})
    ReceiptLedger(registry.store).append(unjudged)
    approve(registry, unjudged.receipt_id, approver_keys, "alice")
    with pytest.raises(PromotionRefused, match="has no gate verdict: materialize release_receipt"):
        promotion.promote(registry, unjudged.receipt_id, "alice", key=approver_keys["alice"], policy=loose)

    judged = passing_receipt(registry, parent, cand, "rcpt-snap-judged", approver_keys, edit=_worse)
    record_as_pipeline(registry, judged)
    approve(registry, judged.receipt_id, approver_keys, "alice")
    with pytest.raises(PromotionRefused, match="promotion under mine .* is refused"):
        promotion.promote(registry, judged.receipt_id, "alice", key=approver_keys["alice"], policy=loose)
    with pytest.raises(PromotionRefused, match="HOLD"):
        promotion.promote(registry, judged.receipt_id, "alice", key=approver_keys["alice"])
    assert [m.to_value for m in registry.history()] == [parent.version]


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_receipt_brought_in_under_a_snapshots_id_is_not_adopted_by_the_pipeline(
    registry, variant, tracking, approver_keys
):
    """Ingesting a hand-made receipt under the id of a snapshot not yet planned does not make it that
    snapshot's plan; and a snapshot's id the pipeline claimed takes no hand-made receipt."""
    from lightning_dagster.gate.ledger import RECEIPT_SNAPSHOTS
    from lightning_dagster.gate.receipt import Approval
    from lightning_dagster.pipeline.context import ForeignReceipt, find_receipt, save_doc
    from lightning_dagster.registry.errors import RegistryError

    parent, (cand,) = bootstrap(registry, variant)
    early = passing_receipt(registry, parent, cand, "rcpt-snap-future", approver_keys)
    (canary,) = early.approvals
    try:
        receipts.approve(
            registry, early.model_copy(update={"approvals": []}), Approval.model_validate(canary.model_dump())
        )
    except TamperedReceipt as refused:  # a deployment with a pipeline key approves no unattested receipt
        assert "not attested" in str(refused)
    # refused as not the pipeline's: unattested on a deployment with a pipeline key, else not its snapshot's
    with pytest.raises(
        (ForeignReceipt, TamperedReceipt), match="was not written by the pipeline|not attested"
    ):
        find_receipt(registry.store, "snap-future")

    save_doc(registry.store, RECEIPT_SNAPSHOTS, "rcpt-snap-claimed", {"snapshot_key": "snap-claimed"})
    claimed = passing_receipt(registry, parent, cand, "rcpt-snap-claimed", approver_keys)
    (canary,) = claimed.approvals
    with pytest.raises(RegistryError, match="whose receipt only the pipeline writes"):
        receipts.approve(registry, claimed.model_copy(update={"approvals": []}), canary)
    assert find_receipt(registry.store, "snap-claimed") is None


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_promotion_replayed_after_a_rollback_is_refused(
    registry, variant, tracking, approver_keys, monkeypatch, capsys
):
    """promote 1 -> 2, a signed rollback 2 -> 1: the pointer holds the receipt's exact parent again, so the
    same receipt and approval passed every check and silently undid the rollback with a decision made
    before it. A receipt moves the pointer once."""
    from lightning_dagster.cli import main

    parent, (cand,) = bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-replay", approver_keys), approver_keys, "alice"
    )
    promotion.promote(registry, "rec-replay", "alice", key=approver_keys["alice"])
    rollbacks.rollback(
        registry, signed_rollback(registry, parent.version, "alice", approver_keys, reason="canary harm")
    )

    with pytest.raises(PromotionRefused, match="receipt rec-replay already moved .* promotes once"):
        promotion.promote(registry, "rec-replay", "alice", key=approver_keys["alice"])
    monkeypatch.setenv("LD_STORE_URL", registry.store.url)
    argv = ["registry", "promote", "rec-replay", "--actor", "alice", "--tracking-uri", tracking.uri]
    assert main([*argv, "--model-name", registry.model_name]) == 1
    assert "already moved" in capsys.readouterr().err
    assert [m.to_value for m in registry.history()] == [parent.version, cand.version, parent.version]
    assert registry.serve_approved(download=False).version == parent.version


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_the_roles_that_approved_a_promotion_may_roll_it_back(registry, variant, tracking, approver_keys):
    """A deployment whose default step is approved in its own role (the receipt's plan names `release-owner`,
    as `default_approver_roles` records it): an actor holding only that role may take the move back, as
    `default-approver` may; a role the receipt does not name may not."""
    from lightning_dagster.release.errors import RollbackRefused

    parent, (cand,) = bootstrap(registry, variant)
    receipt = passing_receipt(registry, parent, cand, "rec-own-role", approver_keys)
    assert receipt.plan.approvers.default == ["release-owner"]
    approve(registry, receipt, approver_keys, "alice")
    promotion.promote(registry, "rec-own-role", "alice", key=approver_keys["alice"])

    with pytest.raises(
        RollbackRefused, match=r"needs one of the roles \['default-approver', 'release-owner'\]"
    ):
        rollbacks.rollback(
            registry, signed_rollback(registry, parent.version, "bob", approver_keys, role="ml-lead")
        )
    # racer0 holds release-owner only: the role that approved the promotion
    rollbacks.rollback(
        registry, signed_rollback(registry, parent.version, "racer0", approver_keys, role="release-owner")
    )
    history = registry.history()
    assert [m.to_value for m in history] == [parent.version, cand.version, parent.version]
    assert history[-1].actor == "racer0"
