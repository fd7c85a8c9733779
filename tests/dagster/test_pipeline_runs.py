"""One snapshot partition through the whole graph, with the real store, engine, gateway, runner, trainer,
gate and MLflow registry: on Dagster's SQLite instance, and on a PostgreSQL instance built from dagster.yaml.
Tiny settings (two RL steps, 8 held-out tasks) and a test policy that does not demand a margin they cannot
show; everything else is the real thing."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
import pytest

from lightning_dagster.demo import approval_config, promotion_config, run_snapshot
from lightning_dagster.orchestration.assets import snapshot_assets
from lightning_dagster.orchestration.definitions import build_definitions
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.snapshots import load_manifest, save_manifest
from lightning_dagster.registry.core import APPROVED
from tests.dagster.conftest import TINY_POLICY, pipeline_for
from tests.dagster.test_pipeline_core import UNSIGNED

ROOT = Path(__file__).resolve().parents[2]
PROMOTE = "PROMOTE TO BOUNDED CANARY"
ALL_ASSETS = {a.key.to_user_string() for a in snapshot_assets}


def _defs():
    p = pipeline_for(TINY_POLICY)
    return build_definitions(deferred=False, **{name: getattr(p, name) for name in ("training", "gate")}), p


def _materialized(results) -> set[str]:
    return {e.asset_key.to_user_string() for r in results for e in r.get_asset_materialization_events()}


def _checks(results) -> dict[str, bool]:
    return {e.check_name: e.passed for r in results for e in r.get_asset_check_evaluations()}


def _launch(defs, instance, job: str, op: str, **config) -> dg.ExecuteInProcessResult:
    return defs.resolve_job_def(job).execute_in_process(
        instance=instance, run_config={"ops": {op: {"config": config}}}, raise_on_error=False
    )


def _error(result: dg.ExecuteInProcessResult, op: str) -> str:
    failure = result.failure_data_for_node(op)
    return failure.error.to_string() if failure else ""


GATEWAY_STARTS: list[int] = []  # pids of the gateway children started while `sqlite_snapshot` ran


@pytest.fixture(scope="session")
def sqlite_snapshot(bootstrapped):
    """Plan, approve, then the rest of the graph on an ephemeral (SQLite-backed) Dagster instance."""
    from lightning_dagster.gateway.process import GatewayProcess

    defs, p = _defs()
    instance = dg.DagsterInstance.ephemeral()
    key = "snap-20261130T0800Z-00000001"
    instance.add_dynamic_partitions(snapshots.name, [key])
    start = GatewayProcess.__init__

    def counted(self, *args, **kwargs):
        start(self, *args, **kwargs)
        GATEWAY_STARTS.append(self.pid)

    GatewayProcess.__init__ = counted
    try:
        results = run_snapshot(defs, instance, key, approver=("alice", "release-owner"))
    finally:
        GatewayProcess.__init__ = start
    return key, results, p


@pytest.mark.slow
def test_one_partition_materializes_end_to_end_on_sqlite(sqlite_snapshot):
    key, results, p = sqlite_snapshot
    failures = [
        e.event_specific_data.error.to_string() for r in results for e in r.all_events if e.is_step_failure
    ]
    assert all(r.success for r in results), "\n".join(failures)
    assert _materialized(results) == ALL_ASSETS
    checks = _checks(results)
    assert len(checks) == 7 and all(checks.values()), checks
    receipt = ctx.find_receipt(p.get_store(), key)
    assert receipt.gate.verdict == PROMOTE
    assert [a.actor for a in receipt.approvals] == ["alice"]
    # Every rollout the stages enqueued carries the snapshot key: the plan's count of each kind, found by it.
    by_kind: dict = {}
    for r in p.get_store().query_rollouts(snapshot_key=key):
        by_kind[r.kind] = by_kind.get(r.kind, 0) + 1
    assert by_kind == receipt.plan.expected_rollouts
    # The stages that serve a model (first batch, training, evaluation, canary) share one gateway child,
    # each with its own weights pushed in; the bootstrap's probe may already have left it (`gateway.pool`).
    assert len(GATEWAY_STARTS) <= 1, GATEWAY_STARTS
    assert (
        receipt.candidate.model_version == ctx.load_stage(p.get_store(), key, "candidate_resource")["version"]
    )
    # The lineage the UI shows: candidate metadata names its snapshot, parent, evaluator and checkpoint URI.
    (candidate,) = [
        e
        for r in results
        for e in r.get_asset_materialization_events()
        if e.asset_key.path == ["candidate_resource"]
    ]
    meta = {k: v.value for k, v in candidate.materialization.metadata.items()}
    assert (
        meta["snapshot"] == key
        and meta["parent"].endswith("/1")
        and meta["checkpoint_uri"].startswith("file://")
    )
    assert candidate.materialization.tags["dagster/data_version"] == meta["weights_hash"]
    # The held-out margin the asset shows is the receipt's check 4 margin, rounded once the same way.
    (holdout,) = [
        e
        for r in results
        for e in r.get_asset_materialization_events()
        if e.asset_key.path == ["holdout_evaluation"]
    ]
    families = receipt.holdout.families
    margin = sum(f.n * (f.candidate_mean - f.parent_mean) for f in families) / sum(f.n for f in families)
    assert holdout.materialization.metadata["margin"].value == round(margin, 4)


@pytest.mark.slow
def test_the_same_snapshot_content_and_parent_make_the_same_candidate_and_verdict(sqlite_snapshot):
    """Reproducible runs, at small scale: a second snapshot frozen with the first one's tasks and seed, from
    the same parent and settings, its rollouts sampled many at a time (their batches as timing makes them),
    trains the same candidate, byte for byte, and gets the same evaluation, verdict and checks."""
    key, _, p = sqlite_snapshot
    defs, _ = _defs()
    instance = dg.DagsterInstance.ephemeral()
    again = "snap-20261130T0800Z-0000a9a1"  # a key of its own: the session's store is shared
    save_manifest(p, again, load_manifest(p, key))
    instance.add_dynamic_partitions(snapshots.name, [again])
    results = run_snapshot(defs, instance, again, approver=("alice", "release-owner"))
    assert all(r.success for r in results)
    first, second = (ctx.find_receipt(p.get_store(), k) for k in (key, again))
    assert (
        second.receipt_id != first.receipt_id
        and second.candidate.weights_hash == first.candidate.weights_hash
    )
    assert first.candidate.weights_hash != ctx.registry(p).model_version("1").weights_hash  # it trained
    assert second.holdout.families == first.holdout.families
    assert second.protected.families == first.protected.families
    gate = ("verdict", "failed_checks", "unavailable_checks", "stale_checks")
    assert [getattr(second.gate, f) for f in gate] == [getattr(first.gate, f) for f in gate]
    # what a rerun needs is in the receipt: the seeds, the thread settings, the torch build
    reproduce = first.plan.algorithm["reproduce"]
    assert second.plan.algorithm == first.plan.algorithm
    assert reproduce["seed"] == ctx.settings(p).training.seed and reproduce[
        "torch"
    ] == importlib.metadata.version("torch")
    assert reproduce["engine_threads"] == ctx.settings(p).serving.engine_threads


@pytest.mark.slow
def test_release_receipt_names_the_model_it_judged_and_the_run_config_to_paste(sqlite_snapshot):
    key, results, p = sqlite_snapshot
    receipt = ctx.find_receipt(p.get_store(), key)
    (event,) = [
        e
        for r in results
        for e in r.get_asset_materialization_events()
        if e.asset_key.path == ["release_receipt"]
    ]
    metadata = event.materialization.metadata
    meta = {k: v.value for k, v in metadata.items()}
    assert meta["verdict"] == PROMOTE and meta["stale"] is False
    assert (meta["candidate_version"], meta["parent_version"]) == (receipt.candidate.model_version, "1")
    assert meta["snapshot"] == key and meta["evaluator"] == "heldout-sampled-success@1"
    # Versions are identifiers, not numbers Dagster's Plots tab would chart.
    assert isinstance(metadata["receipt_version"], dg.TextMetadataValue)
    assert f"receipt_id: {receipt.receipt_id}" in meta["run_config"]
    assert "promote_candidate" in meta["run_config"] and "actor: bob" in meta["run_config"]
    assert {row.data["actor"] for row in meta["actors"].records} == {"alice", "bob"}


@pytest.mark.slow
def test_a_refused_promotion_is_one_line_with_its_reason_not_a_traceback(sqlite_snapshot, bootstrapped):
    key, _, _ = sqlite_snapshot
    defs, p = _defs()
    before = ctx.registry(p).current(APPROVED)
    refused = _launch(
        defs,
        dg.DagsterInstance.ephemeral(),
        "promote",
        "promote_candidate",
        receipt_id=ctx.receipt_id(key),
        actor="bob",
        **UNSIGNED,
    )
    assert not refused.success
    failure = refused.failure_data_for_node("promote_candidate")
    description = failure.user_failure_data.description
    assert description.startswith("promotion refused: ") and "\n" not in description
    assert "no signed default-step approval" in description and "does not hold role" not in description
    assert failure.user_failure_data.metadata["refused"].value == "NotAuthorized"
    assert ctx.registry(p).current(APPROVED) == before


@pytest.fixture
def postgres_instance(postgres_url, tmp_path, bootstrapped):
    """A Dagster instance read from the repository's dagster.yaml, its env vars pointing at the test server."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    url = urlparse(postgres_url)
    env = {
        "DAGSTER_PG_HOST": url.hostname,
        "DAGSTER_PG_PORT": str(url.port),
        "DAGSTER_PG_USER": url.username,
        "DAGSTER_PG_PASSWORD": url.password or "",
        "DAGSTER_PG_DB": url.path.lstrip("/"),
    }
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        yield instance
    finally:
        instance.dispose()
        mp.undo()


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.moves_session_pointer
def test_postgres_instance_blocks_then_approves_then_promotes(postgres_instance):
    from dagster_postgres import PostgresEventLogStorage

    instance = postgres_instance
    assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
    defs, p = _defs()
    registry = ctx.registry(p)
    key = "snap-20261130T0900Z-00000002"
    instance.add_dynamic_partitions(snapshots.name, [key])

    # No approval: check 7 (on rollback_drill) blocks release_receipt in that run; the receipt alone, run
    # next, re-judges everything itself and holds.
    results = run_snapshot(defs, instance, key, approver=None)
    checks = _checks(results)
    assert checks["rollback_and_approval"] is False
    assert all(v for name, v in checks.items() if name != "rollback_and_approval")
    assert "release_receipt" not in _materialized(results[:-1])
    assert _materialized(results[-1:]) == {"release_receipt"}
    receipt = ctx.find_receipt(p.get_store(), key)
    assert receipt.gate.verdict == "HOLD" and receipt.gate.unavailable_checks == [7]

    before = registry.current(APPROVED)
    refused = _launch(
        defs, instance, "promote", "promote_candidate", receipt_id=receipt.receipt_id, actor="bob", **UNSIGNED
    )
    assert not refused.success
    assert "HOLD" in _error(refused, "promote_candidate")
    assert registry.current(APPROVED) == before

    # Approval by the release owner, the receipt re-judged, then promotion by the default approver.
    approved = _launch(
        defs, instance, "approve", "approve_receipt", **approval_config(p, key, ("alice", "release-owner"))
    )
    assert approved.success, _error(approved, "approve_receipt")
    job = defs.resolve_job_def("continual_learning")
    rejudged = job.execute_in_process(
        instance=instance, partition_key=key, asset_selection=[dg.AssetKey("release_receipt")]
    )
    assert rejudged.success and ctx.find_receipt(p.get_store(), key).gate.verdict == PROMOTE
    # Promotion needs the default approver's own signed approval of the judged evidence.
    bob = _launch(
        defs, instance, "approve", "approve_receipt", **approval_config(p, key, ("bob", "default-approver"))
    )
    assert bob.success, _error(bob, "approve_receipt")
    signed = promotion_config(p, receipt.receipt_id, "bob")  # bob signs the move, as `sign-promote` does
    assert _launch(defs, instance, "promote", "promote_candidate", **signed).success
    assert registry.current(APPROVED) == ctx.find_receipt(p.get_store(), key).candidate.model_version
    # The materializations are in PostgreSQL.
    assert instance.get_latest_materialization_event(dg.AssetKey("release_receipt")) is not None


def test_stale_evidence_sensor_marks_receipts_judged_by_another_evaluator(sqlite_snapshot):
    """A new evaluator version voids the held-out and protected checks of receipts judged by the old one;
    the sensor marks each such receipt once (its cursor names it) with an observation the UI shows on
    release_receipt, and writes nothing itself."""
    from lightning_dagster.orchestration.sensors import stale_evidence_sensor

    key, _, _ = sqlite_snapshot
    p = pipeline_for(TINY_POLICY, evaluator_version="2")
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshots.name, [key])
    with dg.build_sensor_context(instance=instance, resources={"pipeline": p}) as context:
        result = stale_evidence_sensor(context)
    (obs,) = result.asset_events
    meta = {k: v.value for k, v in obs.metadata.items()}
    assert obs.partition == key and meta["stale"] is True
    assert {"4", "5"} <= set(meta["void_checks"]) and "evaluator" in meta["changed"]
    # Which setting changed, and the same stale checks the receipt's metadata would name.
    assert meta["changed_settings"] == {"evaluator": ["version: 1 -> 2"]}
    assert meta["stale_checks"] == [4, 5] and "version: 1 -> 2" in obs.description
    assert meta["receipt_id"] == ctx.receipt_id(key)
    with dg.build_sensor_context(
        instance=instance, resources={"pipeline": p}, cursor=result.cursor
    ) as context:
        again = stale_evidence_sensor(context)
    assert not getattr(again, "asset_events", None)  # each receipt is marked once
