"""The calc project's whole continual-learning graph with `serving.engine: vllm`: a vLLM CPU server (started
and owned by the gateway) serves every stage, the parent's first batch, each RL step's samples with the
trainer's weights synced in, the held-out and protected evaluation, the canary and the rollback drill; once
syncing whole weights and once a LoRA adapter. The receipt's checks all have evidence, and every LLM span of
the snapshot says vLLM served it."""

from __future__ import annotations

import dagster as dg
import pytest

from lightning_dagster.demo import run_snapshot
from lightning_dagster.orchestration.definitions import build_definitions
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import ServingResource
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.types import SpanKind
from tests.dagster.conftest import TINY_POLICY, pipeline_for, tiny_training

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.vllm_graph, pytest.mark.timeout(2400)]
KEYS = {"full": "snap-20261204T0900Z-0000f011", "lora": "snap-20261204T0900Z-00001a0a"}


@pytest.fixture(scope="module", params=["full", "lora"])
def vllm_snapshot(request, bootstrapped):
    from lightning_dagster.engine.vllm_server import VllmUnavailable, vllm_python

    try:
        vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"vLLM venv not found: {exc}")
    adapter, key = request.param, KEYS[request.param]
    p = pipeline_for(TINY_POLICY)
    defs = build_definitions(
        deferred=False,
        training=tiny_training(adapter=adapter, lora_rank=4, learning_rate=1e-4),
        gate=p.gate,
        serving=ServingResource(engine="vllm", max_batch=16),
    )
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshots.name, [key])
    results = run_snapshot(defs, instance, key, approver=("alice", "release-owner"))
    return adapter, key, results, defs.resources["pipeline"]


def test_every_stage_runs_on_vllm_and_the_receipt_has_evidence_for_every_check(vllm_snapshot):
    adapter, key, results, p = vllm_snapshot
    failures = [
        e.event_specific_data.error.to_string() for r in results for e in r.all_events if e.is_step_failure
    ]
    materialized = {
        e.asset_key.to_user_string() for r in results for e in r.get_asset_materialization_events()
    }
    assert "release_receipt" in materialized, "\n".join(failures)
    store = p.get_store()
    receipt = ctx.find_receipt(store, key)
    assert receipt.gate is not None, "\n".join(failures)
    assert receipt.gate.unavailable_checks == [], "\n".join(failures)
    assert receipt.rollback_drill is not None and receipt.rollback_drill.environment.endswith(", vllm")
    rollouts = store.query_rollouts(snapshot_key=key)
    kinds = {r.kind for r in rollouts}
    assert {"train", "holdout", "protected", "canary"} <= {str(k.value) for k in kinds}
    spans = [
        s for s in store.list_spans(rollout_ids=[r.rollout_id for r in rollouts]) if s.kind == SpanKind.llm
    ]
    assert spans and {s.attributes["backend"] for s in spans} == {"vllm"}
    # RL steps 2.. sampled from the trainer's weights, pushed into vLLM and verified before they counted
    candidate_steps = {s.resource_id for s in spans if s.resource_id and "@" in s.resource_id}
    assert candidate_steps, "no span was served from a step's synced weights"
    if adapter == "lora":  # served under the adapter's own name, not the base model's
        assert {s.attributes["model"] for s in spans if s.resource_id in candidate_steps} == candidate_steps
