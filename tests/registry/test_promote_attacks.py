"""Promotion against a hostile registry: an artifact swapped behind a registered version, a receipt edited in
the ledger. Each is refused with its reason and `approved-default` stays where it was."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from lightning_dagster.registry import NotAuthorized, PromotionRefused
from tests.registry.helpers import approve, passing_receipt
from tests.registry.test_pointers import _artifact_files, _bootstrap


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_a_candidate_whose_artifact_was_swapped_is_not_promoted(registry, variant, tracking, approver_keys):
    parent, (cand,) = _bootstrap(registry, variant)
    approve(
        registry, passing_receipt(registry, parent, cand, "rec-swap", approver_keys), approver_keys, "alice"
    )
    registry.download(cand.version)  # this host's cache holds the right bytes (as after the canary)
    (weights,) = _artifact_files(tracking, cand.run_id, "model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))  # the learner rewrites the registered artifact

    with pytest.raises(
        PromotionRefused, match=f"candidate version {cand.version}'s artifact is not the weights"
    ):
        registry.promote("rec-swap", "alice")
    assert [m.to_value for m in registry.history()] == [parent.version]
    assert registry.serve_approved(download=False).version == parent.version


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_cli_promote_of_a_receipt_edited_in_the_ledger_is_refused_in_one_line(
    registry, variant, tracking, approver_keys, monkeypatch, capsys
):
    from lightning_dagster.cli import main

    parent, (cand,) = _bootstrap(registry, variant)
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

    parent, (cand,) = _bootstrap(registry, variant)
    approve(
        registry,
        passing_receipt(registry, parent, cand, "rec-rb-role", approver_keys),
        approver_keys,
        "alice",
    )
    registry.promote("rec-rb-role", "alice")
    # bob holds ml-lead only, alice also roles-admin: naming a role one holds is not leave to move the pointer.
    for actor, role in (("bob", "ml-lead"), ("alice", "roles-admin")):
        with pytest.raises(NotAuthorized, match="needs one of the roles"):
            registry.rollback(parent.version, actor, role=role)
    monkeypatch.setenv("LD_STORE_URL", registry.store.url)
    argv = ["registry", "rollback", parent.version, "--actor", "bob", "--role", "ml-lead"]
    assert main([*argv, "--tracking-uri", tracking.uri, "--model-name", registry.model_name]) == 1
    assert "needs one of the roles ['default-approver']" in capsys.readouterr().err
    assert [m.to_value for m in registry.history()] == [parent.version, cand.version]
