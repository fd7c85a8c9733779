"""The MLflow mirror cannot outvote the store: an alias moved behind the registry's back is refused by
serving, restored by the watch, and recorded as an incident that `registry history` shows."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from lightning_dagster.registry import APPROVED, AliasDiverged, PointerIncident
from lightning_dagster.release.cli import register
from tests.registry.helpers import candidate_kwargs, signed_move

pytestmark = pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)


def _alias(tracking, model_name: str) -> str | None:
    version = MlflowClient(tracking.uri, tracking.uri).get_registered_model(model_name).aliases.get(APPROVED)
    return None if version is None else str(version)


def _history_cli(registry, tracking, store_url, capsys, *extra: str) -> str:
    return _registry_cli("history", registry, tracking, store_url, capsys, *extra)


def _registry_cli(command, registry, tracking, store_url, capsys, *extra: str, status: int = 0) -> str:
    import argparse

    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(
        [
            command,
            "--tracking-uri",
            tracking.uri,
            "--store-url",
            store_url,
            "--model-name",
            registry.model_name,
        ]
        + list(extra)
    )
    assert args.handler(args) == status
    out = capsys.readouterr()
    return out.out + out.err


def test_an_alias_moved_behind_the_registry_is_refused_restored_and_recorded(
    registry, variant, tracking, store_url, capsys
):
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    assert registry.serve_approved(download=False).version == parent.version
    assert registry.incidents() == []
    before = time.time()

    # MLflow's UI ("Promote model", the alias editor) does exactly this call.
    MlflowClient(tracking.uri, tracking.uri).set_registered_model_alias(
        registry.model_name, APPROVED, cand.version
    )
    with pytest.raises(AliasDiverged) as refused:
        registry.serve_approved()
    assert (refused.value.alias_version, refused.value.store_version) == (cand.version, parent.version)
    assert registry.incidents() == []  # serving refuses; it neither repairs nor records
    refusal = _registry_cli("serving", registry, tracking, store_url, capsys, status=1)
    assert len(refusal.strip().splitlines()) == 1 and "approved-default" in refusal
    assert cand.version in refusal and parent.version in refusal

    rec = registry.reconcile(last_verified=before - 5)
    assert _alias(tracking, registry.model_name) == parent.version
    incident = rec.incident
    assert isinstance(incident, PointerIncident) and incident.number == 1
    assert (incident.found_version, incident.store_version, incident.store_seq) == (
        cand.version,
        parent.version,
        1,
    )
    assert incident.restored and incident.error is None and incident.moved_by == "unknown"
    assert before <= incident.detected_at <= time.time()
    assert incident.not_before is not None and before - 5 <= incident.not_before < incident.detected_at
    assert registry.incidents() == [incident]  # kept in the store, not only returned
    assert registry.serve_approved(download=False).version == parent.version
    served = json.loads(_registry_cli("serving", registry, tracking, store_url, capsys, "--json"))
    assert served["version"] == parent.version and Path(served["local_path"]).is_dir()
    assert [m.to_value for m in registry.history()] == [parent.version]  # the store's record never moved

    # Restored and agreeing: the next check records nothing more.
    assert registry.reconcile().incident is None and len(registry.incidents()) == 1

    text = _history_cli(registry, tracking, store_url, capsys)
    assert "INCIDENTS" in text
    (line,) = [row for row in text.splitlines() if row.strip().startswith("!")]
    assert f"alias was {cand.version}, store {parent.version}" in line and "restored" in line
    assert "moved by unknown" in line
    rows = json.loads(_history_cli(registry, tracking, store_url, capsys, "--json"))
    assert [row["kind"] for row in rows] == ["move", "incident"]  # one timeline, oldest first
    assert rows[0]["to"] == parent.version
    assert {k: v for k, v in rows[1].items() if k not in ("kind", "at")} == incident.to_dict()


def test_a_deleted_alias_is_an_incident_too(registry, variant, tracking):
    parent = registry.register_initial_parent(variant(0))
    MlflowClient(tracking.uri, tracking.uri).delete_registered_model_alias(registry.model_name, APPROVED)
    with pytest.raises(AliasDiverged):
        registry.serve_approved(download=False)
    incident = registry.reconcile().incident
    assert (incident.found_version, incident.store_version) == (None, parent.version)
    assert _alias(tracking, registry.model_name) == parent.version


def test_a_mirror_write_lost_after_a_move_is_repaired_without_an_incident(
    registry, variant, tracking, approver_keys
):
    """The store moved and the MLflow write never happened (a crash, an outage): the alias lags behind at
    the registry's own last write. That is repaired, but nobody moved the alias, so nothing is recorded."""
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    signed_move(registry, cand.version, approver_keys)
    with pytest.raises(AliasDiverged):  # serving still refuses the lagging alias
        registry.serve_approved(download=False)
    rec = registry.reconcile()
    assert rec.changed and rec.incident is None and registry.incidents() == []
    assert _alias(tracking, registry.model_name) == cand.version


def test_an_alias_moved_back_to_an_earlier_approved_version_is_an_incident(
    registry, variant, tracking, approver_keys
):
    """A version approved once before is still not the pointer: moving the alias back to it is recorded."""
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    signed_move(registry, cand.version, approver_keys)
    assert registry.reconcile().incident is None  # the registry's own mirror write
    MlflowClient(tracking.uri, tracking.uri).set_registered_model_alias(
        registry.model_name, APPROVED, parent.version
    )
    incident = registry.reconcile().incident
    assert (incident.found_version, incident.store_version, incident.store_seq) == (
        parent.version,
        cand.version,
        2,
    )
    assert _alias(tracking, registry.model_name) == cand.version
