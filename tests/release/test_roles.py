"""The deployment's roles file: what it must hold, and where it may not lie."""

from __future__ import annotations

import pytest

from lightning_dagster.release.errors import NotAuthorized, RolesConfigError
from lightning_dagster.release.roles import read_roles_file


def test_roles_file_rules(tmp_path, approver_keys):
    from lightning_dagster import paths
    from lightning_dagster.release.signing import load_private_key, public_key_line

    key = public_key_line(load_private_key(approver_keys["alice"]))
    good = tmp_path / "roles.yaml"
    good.write_text(f"actors:\n  alice:\n    roles: [release-owner]\n    key: {key}\n")
    roles = read_roles_file(good)
    roles.require("alice", "release-owner")
    with pytest.raises(NotAuthorized):
        roles.require("alice", "ml-lead")
    inside = paths.models_dir() / "roles.yaml"  # the trainer writes here: it must not grant approvals
    inside.write_text(good.read_text())
    with pytest.raises(RolesConfigError, match="write surface"):
        read_roles_file(inside)
    with pytest.raises(RolesConfigError, match="does not exist"):
        read_roles_file(tmp_path / "missing.yaml")
    for text, problem in (
        ("actors:\n  alice: [release-owner]\n", "exactly `roles` and `key`"),
        (f"actors:\n  alice:\n    roles: release-owner\n    key: {key}\n", "list of role names"),
        ("actors:\n  alice:\n    roles: [release-owner]\n    key: ed25519:AAAA\n", "32 bytes"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(RolesConfigError, match=problem):
            read_roles_file(bad)
