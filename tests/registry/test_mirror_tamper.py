"""`reconcile` compares the whole MLflow mirror of `approved-default` (alias, the pointer version's tags, the
registered model's tags and description, the approved flags) with the store: a tampered field is an
incident (`tampered=True`, naming what differed) and is restored; a current mirror costs three calls."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from lightning_dagster.registry import APPROVED
from tests.registry.helpers import candidate_kwargs, signed_move

pytestmark = pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)


@pytest.fixture
def mirrored(registry, variant, tracking, approver_keys):
    """A pointer moved twice (bootstrap, then to a candidate) and mirrored; returns (parent, cand, client)."""
    assert tracking.uri.startswith("sqlite:////")  # a real SQLite tracking store at an absolute path
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    signed_move(registry, cand.version, approver_keys)
    assert registry.reconcile().incident is None  # the registry's own mirror write
    return parent, cand, MlflowClient(tracking.uri, tracking.uri)


def _snapshot(registry, client) -> dict:
    rm = client.get_registered_model(registry.model_name)
    versions = client.search_model_versions(f"name='{registry.model_name}'")
    return {
        "alias": str(rm.aliases.get(APPROVED)),
        "model_tags": {k: v for k, v in rm.tags.items() if k.startswith(APPROVED)},
        "description": rm.description,
        "version_tags": {
            str(v.version): {
                k: t for k, t in v.tags.items() if k.startswith(APPROVED) or k == "approved_default"
            }
            for v in versions
        },
    }


@pytest.mark.parametrize(
    "tamper, field",
    [
        (lambda c, m, p, v: c.set_registered_model_alias(m, APPROVED, p), "alias"),
        (
            lambda c, m, p, v: c.set_model_version_tag(m, v, f"{APPROVED}.approved_by", "mallory"),
            "approved_by",
        ),
        (
            lambda c, m, p, v: c.set_model_version_tag(m, v, f"{APPROVED}.receipt_id", "rec-forged"),
            "receipt_id",
        ),
        (lambda c, m, p, v: c.delete_model_version_tag(m, v, f"{APPROVED}.approved_at"), "approved_at"),
        (lambda c, m, p, v: c.set_model_version_tag(m, p, "approved_default", "true"), "flagged"),
        (lambda c, m, p, v: c.set_registered_model_tag(m, f"{APPROVED}.history", "[]"), "history"),
        (lambda c, m, p, v: c.set_registered_model_tag(m, f"{APPROVED}.moves", "1"), "moves"),
        (lambda c, m, p, v: c.update_registered_model(m, "approved: version 1"), "description"),
    ],
    ids=["alias", "approved_by", "receipt_id", "approved_at", "flagged", "history", "moves", "description"],
)
def test_each_tampered_field_is_an_incident_and_is_restored(registry, mirrored, tamper, field):
    parent, cand, client = mirrored
    before = _snapshot(registry, client)
    tamper(client, registry.model_name, parent.version, cand.version)
    assert _snapshot(registry, client) != before
    rec = registry.reconcile()
    incident = rec.incident
    assert incident is not None and incident.tampered and incident.restored
    assert field in incident.differences[0], incident.differences
    # An alias moved elsewhere also shows that version's tags (it is not flagged as the approved one); any
    # other field is the one difference.
    assert len(incident.differences) == 1 or field == "alias", incident.differences
    assert (incident.store_version, incident.store_seq) == (cand.version, 2)
    assert _snapshot(registry, client) == before  # the whole mirror is back as the store says
    assert registry.incidents() == [incident]
    assert "tampered" in incident.summary() or field == "alias"
    assert registry.reconcile().incident is None and len(registry.incidents()) == 1
    assert [m.to_value for m in registry.history()] == [parent.version, cand.version]  # the store stands


def test_a_mirror_behind_the_store_is_repaired_without_an_incident(registry, mirrored, approver_keys):
    parent, cand, client = mirrored
    signed_move(registry, parent.version, approver_keys, rollback=True)
    rec = registry.reconcile()
    assert rec.changed and rec.incident is None and registry.incidents() == []
    snap = _snapshot(registry, client)
    assert snap["alias"] == parent.version
    assert snap["version_tags"][parent.version][f"{APPROVED}.approved_by"] == "alice"
    assert snap["version_tags"][cand.version]["approved_default"] == "false"
    assert snap["model_tags"][f"{APPROVED}.moves"] == "3"


def test_a_current_mirror_is_checked_in_three_mlflow_calls(registry, mirrored):
    calls: list[str] = []
    real = registry.call_mlflow

    def counted(what, fn, *args, **kwargs):
        calls.append(what)
        return real(what, fn, *args, **kwargs)

    registry.call_mlflow = counted
    rec = registry.reconcile()
    assert not rec.changed and rec.incident is None
    assert sorted(calls) == ["get alias", "get registered model", "search versions"]
