"""The `registry` command end to end: approve a receipt file, promote with a key, show, roll back, history."""

from __future__ import annotations

import json

import pytest

from lightning_dagster.gate import ReceiptLedger
from lightning_dagster.registry import APPROVED
from lightning_dagster.release.cli import register
from lightning_dagster.release.roles import registry_roles
from tests.registry.helpers import candidate_kwargs, passing_receipt, record_as_pipeline


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_cli_show_history_approve_promote_rollback(
    registry, variant, tracking, store_url, roles_file, approver_keys, capsys
):
    import argparse

    registry_roles(registry)  # the deployment pins its roles file in the store
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    receipt_file = registry.cache_dir.parent / "receipt.json"
    record_as_pipeline(registry, passing_receipt(registry, parent, cand, "rec-cli", approver_keys))
    receipt = ReceiptLedger(registry.store).head("rec-cli")  # the file holds the pipeline's receipt
    receipt_file.write_text(json.dumps(receipt.to_json_dict()))
    common = ["--tracking-uri", tracking.uri, "--store-url", store_url, "--model-name", registry.model_name]

    def run(*argv: str) -> tuple[int, str]:
        parser = argparse.ArgumentParser()
        register(parser)
        args = parser.parse_args([*argv, *common])
        code = args.handler(args)
        return code, capsys.readouterr().out

    def signed(actor: str, role: str = "release-owner") -> list[str]:
        return ["--actor", actor, "--role", role, "--key", str(approver_keys[actor])]

    code, out = run("approve", str(receipt_file), *signed("alice"), "--step", "canary", "--json")
    assert code == 0 and json.loads(out)["version"] == 2
    assert run("approve", "rec-cli", *signed("bob"))[0] == 1
    assert run("promote", "rec-cli", "--actor", "alice")[0] == 1  # no signed default-step approval yet
    code, out = run("promote", "rec-cli", "--actor", "alice", "--key", str(approver_keys["alice"]), "--json")
    assert code == 0 and json.loads(out)["to"] == cand.version
    code, out = run("show", "--json")
    shown = json.loads(out)
    assert shown[APPROVED] == cand.version and shown["latest-candidate"] == cand.version
    assert [v["version"] for v in shown["versions"]] == [cand.version, parent.version]
    back = ["--actor", "alice", "--key", str(approver_keys["alice"]), "--reason", "back", "--json"]
    assert run("rollback", parent.version, "--actor", "alice", "--reason", "unsigned")[0] == 2
    code, out = run("rollback", parent.version, *back)
    assert code == 0 and json.loads(out)["to"] == parent.version
    code, out = run("history", "--json")
    assert [(m["from"], m["to"]) for m in json.loads(out)] == [
        (None, parent.version),
        (parent.version, cand.version),
        (cand.version, parent.version),
    ]
    code, out = run("history")
    assert code == 0 and "alice" in out and "bootstrap" in out
