"""The calc project's whole continual-learning graph with `serving.engine: vllm`: a vLLM CPU server (started
and owned by the gateway) serves every stage, the parent's first batch, each RL step's samples with the
trainer's weights synced in, the held-out and protected evaluation, the canary and the rollback drill; once
syncing whole weights and once a LoRA adapter. The receipt's checks all have evidence, every LLM span of the
snapshot says vLLM served it, and a sample of each stage's calls, replayed against the same server while it
still served that stage's weights (`tests.support.vllm_replay`), returns the recorded ids and logprobs."""

from __future__ import annotations

import dagster as dg
import pytest

from lightning_dagster.demo import run_snapshot
from lightning_dagster.orchestration.definitions import build_definitions
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import ServingResource
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.types import RolloutKind, SpanKind
from tests.dagster.conftest import TINY_POLICY, pipeline_for, tiny_training
from tests.support import vllm_replay

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.vllm_graph, pytest.mark.timeout(2400)]
KEYS = {"full": "snap-20261204T0900Z-0000f011", "lora": "snap-20261204T0900Z-00001a0a"}


@pytest.fixture(scope="module", params=["full", "lora"])
def vllm_snapshot(request, bootstrapped, tmp_path_factory):
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
    replays = tmp_path_factory.mktemp(f"vllm-replays-{adapter}")
    with pytest.MonkeyPatch.context() as mp:  # replayed as each stage runs, in this and the trainer's process
        mp.setenv(vllm_replay.REPLAYS_ENV, str(replays))
        vllm_replay.install(mp, replays)
        vllm_replay.replaying_trainer(mp)
        results = run_snapshot(defs, instance, key, approver=("alice", "release-owner"))
    return adapter, key, results, defs.resources["pipeline"], vllm_replay.read(replays)


def test_every_stage_runs_on_vllm_and_the_receipt_has_evidence_for_every_check(vllm_snapshot):
    adapter, key, results, p, _ = vllm_snapshot
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


# replays per stage at least: two calls of each batch (the held-out evaluation runs four), the drill's one
MIN_REPLAYS = {
    "rollouts": 2,
    "candidate_resource": 2,
    "holdout_evaluation": 8,
    "canary_results": 2,
    "rollback_drill": 1,
}


def stage_of(replay: dict, rollouts: dict, key: str) -> str | None:
    """The graph stage whose call `replay` repeated, read from its rollout in the store: kind and group id
    (`<tag>-g<task>`, the tag each stage gives its batches). The drill's probe records its call in a scratch
    store, gone with the probe: its replay says so itself (`probe`)."""
    if replay["origin"] == "probe":
        return "rollback_drill"
    r = rollouts.get(replay["rollout_id"])
    if r is None:
        return None
    tag = (r.group_id or "").rpartition("-g")[0]
    if r.kind == RolloutKind.canary and tag == f"{key}-canary":
        return "canary_results"
    if r.kind in (RolloutKind.holdout, RolloutKind.protected) and tag in (
        f"{key}-parent-{r.kind.value}",
        f"{key}-candidate-{r.kind.value}",
    ):
        return "holdout_evaluation"
    if r.kind == RolloutKind.train and tag == f"{key}-s1":  # the first batch, sampled from the parent
        return "rollouts"
    if (r.kind == RolloutKind.train and tag.startswith(f"{key}-s")) or r.kind == RolloutKind.validation:
        return "candidate_resource"  # RL steps 2.. on the trainer's weights, the checkpoints' validation
    return None


def test_a_sample_of_each_stages_calls_replays_exactly_on_the_weights_that_served_it(vllm_snapshot):
    adapter, key, _, p, replays = vllm_snapshot
    store = p.get_store()
    receipt = ctx.find_receipt(store, key)
    rollouts = {r.rollout_id: r for r in store.query_rollouts(rollout_ids=[e["rollout_id"] for e in replays])}
    by_stage: dict[str | None, list[dict]] = {}
    for replay in replays:
        by_stage.setdefault(stage_of(replay, rollouts, key), []).append(replay)
    counts = {stage: len(entries) for stage, entries in by_stage.items()}
    assert set(counts) == set(MIN_REPLAYS), counts
    assert all(counts[stage] >= n for stage, n in MIN_REPLAYS.items()), counts
    for stage, entries in by_stage.items():
        for e in entries:
            where = f"{stage}: span {e['span_id']} of {e['resource_id']} ({e['model']} at {e['upstream']})"
            assert "error" not in e, f"{where}: {e['error']}"
            assert e["ids"] == e["recorded_ids"], where
            assert e["logprobs"] == pytest.approx(e["recorded_logprobs"], abs=vllm_replay.LOGPROB_ABS), where
    # the weights each replay ran on: the stage's own, still served when it was made
    parent, candidate = receipt.plan.parent, receipt.plan.candidate_id
    assert {e["resource_id"] for e in by_stage["rollouts"]} == {parent.resource_id}
    assert {e["resource_id"] for e in by_stage["holdout_evaluation"]} == {parent.resource_id, candidate}
    assert {e["resource_id"] for e in by_stage["canary_results"]} == {candidate}
    sampled = {
        e["resource_id"] for e in by_stage["candidate_resource"] if rollouts[e["rollout_id"]].kind == "train"
    }
    assert sampled and all(r.startswith(f"{candidate}@") for r in sampled), sampled
    if parent.weights_hash is not None:
        for stage in ("rollouts", "rollback_drill"):
            assert {e["weights"]["hash"] for e in by_stage[stage]} == {parent.weights_hash}, stage
    if adapter == "lora":  # RL steps sampled from the adapter, replayed under its name
        assert {e["model"] for e in by_stage["candidate_resource"] if e["resource_id"] in sampled} == sampled
