"""The rollback drill's one mapping into the receipt: a step not reached is unavailable, a failed one false."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_dagster.gate import load_policy, load_receipt
from lightning_dagster.gate.checks import check_rollback_and_approval
from lightning_dagster.gate.receipt import add_rollback_drill
from lightning_dagster.registry import DrillResult, Registry
from tests.registry.helpers import EXAMPLE_RECEIPT


def _check_7(drill: DrillResult):
    """Check 7 on the gate fixture's passing receipt A with only its rollback drill replaced by `drill`."""
    receipt = load_receipt(EXAMPLE_RECEIPT)
    evidence = drill.to_receipt_drill(receipt.plan.parent.resource_id)
    return evidence, check_rollback_and_approval(add_rollback_drill(receipt, evidence), load_policy())


def test_unreachable_mlflow_makes_every_step_unavailable_not_failed(tmp_path, roles_file):
    from lightning_dagster.store import Store
    from tests.registry.mlflow_server import free_port

    store = Store(f"sqlite:///{tmp_path / 's.db'}")
    registry = Registry(f"http://127.0.0.1:{free_port()}", store, roles_file=roles_file)
    drill = registry.rollback_drill("1")
    assert drill.unavailable and not drill.ok
    evidence, check = _check_7(drill)
    assert (evidence.resolved, evidence.loaded, evidence.routed_back) == (None, None, None)
    assert check.status == "unavailable", check.reason
    assert "resolution was not tested" in check.reason
    (recorded,) = store.document_versions("rollback_drills", f"{registry.model_name}/1")
    assert recorded.body["unavailable"] and "unavailable" in recorded.body["error"]
    store.close()


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_bad_weights_hash_fails_resolution_and_leaves_later_steps_untested(registry, variant, tracking):
    parent = registry.register_initial_parent(variant(0))
    (weights,) = [
        p for p in Path(tracking.artifact_root).rglob("model.safetensors") if parent.run_id in p.parts
    ]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    drill = registry.rollback_drill(parent.version, record=False)
    assert drill.resolved and not drill.hash_ok and "WeightsMismatch" in drill.error
    evidence, check = _check_7(drill)
    assert (evidence.resolved, evidence.loaded, evidence.routed_back) == (False, None, None)
    assert check.status == "fail" and "did not resolve" in check.reason


@pytest.mark.parametrize("tracking", ["sqlite"], indirect=True)
def test_loaded_but_not_served_fails_routing_back(registry, variant, monkeypatch):
    from lightning_dagster.registry import approved

    def loads_then_fails(path, *, on_loaded=None, timeout=60.0, serving=None):
        on_loaded()
        raise RuntimeError("gateway answered 500")

    monkeypatch.setattr(approved, "serve_once", loads_then_fails)
    parent = registry.register_initial_parent(variant(0))
    drill = registry.rollback_drill(parent.version, record=False)
    assert drill.hash_ok and drill.loaded and not drill.served and "gateway answered 500" in drill.error
    evidence, check = _check_7(drill)
    assert (evidence.resolved, evidence.loaded, evidence.routed_back) == (True, True, False)
    assert check.status == "fail" and "did not return to the parent" in check.reason
    assert check.reason.count("not tested") == 0
