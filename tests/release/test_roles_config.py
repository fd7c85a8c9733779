"""The roles pin against the deployment's configuration: a configured roles file other than the verified pin
is a loud error naming both hashes on every entry point (the registry command included); a change of the pin
passes only when signed by the configured roles-admin key, never by a key the store's roles hold."""

from __future__ import annotations

import argparse

import pytest

from lightning_dagster.registry import Registry
from lightning_dagster.release.cli import register
from lightning_dagster.release.errors import NotAuthorized, RolesConfigError
from lightning_dagster.release.roles import pin_fields, pin_roles, pin_state, read_roles_file, registry_roles
from lightning_dagster.release.signing import ROLES_PIN, load_private_key, sign
from lightning_dagster.settings import GateSettings
from tests.registry.helpers import bootstrap

pytestmark = pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)


def _cli(capsys, registry, tracking, store_url, *argv) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    register(parser)
    common = ["--tracking-uri", tracking.uri, "--store-url", store_url, "--model-name", registry.model_name]
    args = parser.parse_args([*argv, *common])
    status = args.handler(args)
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.fixture
def other_roles(roles_file, tmp_path):
    """The deployment's roles with bob made a default-approver too: another roles file, another hash."""
    path = tmp_path / "roles-b.yaml"
    path.write_text(roles_file.read_text().replace("roles: [ml-lead]", "roles: [ml-lead, default-approver]"))
    assert read_roles_file(path).digest != read_roles_file(roles_file).digest
    return path


def test_a_configured_roles_file_other_than_the_pin_is_refused_naming_both_hashes(
    registry, variant, roles_file, other_roles, tracking, store_url, capsys, monkeypatch
):
    bootstrap(registry, variant, 0)
    pinned = registry_roles(registry).digest  # the first use pins the configured file, unsigned
    assert _cli(capsys, registry, tracking, store_url, "show")[0] == 0
    monkeypatch.setenv("LD_ROLES_FILE", str(other_roles))
    status, _, err = _cli(capsys, registry, tracking, store_url, "show")
    assert status == 1 and pinned in err and read_roles_file(other_roles).digest in err, err
    for command in ("history", "serving"):
        assert _cli(capsys, registry, tracking, store_url, command)[0] == 1


def test_only_the_configured_roles_admin_key_changes_the_pin(
    registry, variant, roles_file, other_roles, approver_keys, deployment_keys, tracking, store_url, capsys,
    monkeypatch,
):  # fmt: skip
    bootstrap(registry, variant, 0)
    before = registry_roles(registry).digest
    new = read_roles_file(other_roles).digest
    # alice holds `roles-admin` in the pinned roles: a key the store's roles name changes nothing.
    status, _, err = _cli(capsys, registry, tracking, store_url, "roles", "--pin", str(other_roles),
                          "--key", str(approver_keys["alice"]))  # fmt: skip
    assert status == 1 and "configured roles-admin key" in err, err
    fields = pin_fields(before, new, pin_seq=pin_state(registry.store)[1])
    by_alice = sign(load_private_key(approver_keys["alice"]), ROLES_PIN, fields)
    with pytest.raises(NotAuthorized, match="configured roles-admin"):
        pin_roles(registry.store, read_roles_file(other_roles), registry.gate, signature=by_alice)
    assert registry_roles(registry).digest == before
    # The configured roles-admin key signs the change: it passes, and the configuration then names the new file.
    status, out, err = _cli(capsys, registry, tracking, store_url, "roles", "--pin", str(other_roles),
                            "--key", str(deployment_keys["roles-admin"]))  # fmt: skip
    assert status == 0 and new in out, err
    with pytest.raises(RolesConfigError, match=new):  # the old file configured: refused, naming both
        registry_roles(registry)
    monkeypatch.setenv("LD_ROLES_FILE", str(other_roles))
    status, out, _ = _cli(capsys, registry, tracking, store_url, "show")
    assert status == 0 and "history           verified" in out, out
    moved = Registry(registry.tracking_uri, registry.store, registry.model_name, roles_file=other_roles)
    assert registry_roles(moved).digest == new and moved.verified().problem is None


def test_nothing_configured_says_what_to_configure(registry, variant, tracking):
    bootstrap(registry, variant, 0)
    registry_roles(registry)
    bare = Registry(registry.tracking_uri, registry.store, registry.model_name, gate=GateSettings())
    with pytest.raises(RolesConfigError, match=r"LD_ROLES_FILE.*LD_ROLES_ADMIN_KEY"):
        bare.verified()
