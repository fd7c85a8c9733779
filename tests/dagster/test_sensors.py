"""Sensor ticks with `dg.build_sensor_context`: new evidence cuts a partition and requests a run, a stop
condition pauses with its reason (kept in the store), the watermark cursor advances, and the alias watch
restores an MLflow alias moved behind the registry's back."""

from __future__ import annotations

import datetime as dt
import json

import dagster as dg
import pytest
from mlflow import MlflowClient

from lightning_dagster.partitions import snapshots
from lightning_dagster.pipeline.snapshots import SNAPSHOT_KEY_PATTERN, load_manifest
from lightning_dagster.pipeline.triggers import PAUSE_FLAG
from lightning_dagster.resources import MLflowResource
from lightning_dagster.sensors import approved_alias_sensor, continual_learning_sensor, nightly_snapshot
from lightning_dagster.types import AttemptState, Reward
from tests.dagster.conftest import pipeline_for


def _tick(p, instance, cursor=None):
    """One tick, as the sensor function returns it (a SensorResult or a SkipReason)."""
    with dg.build_sensor_context(instance=instance, resources={"pipeline": p}, cursor=cursor) as context:
        return continual_learning_sensor(context)


def _serve_rollouts(store, n: int, session: str) -> None:
    """Finished, rewarded serve rollouts, as the gateway's serve mode records them."""
    for i in range(n):
        rollout, attempt = store.get_or_create_serve_rollout(f"{session}-{i}", None)
        store.transition_attempt(attempt.attempt_id, AttemptState.succeeded, reason_code="ok")
        store.add_reward(Reward(rollout_id=rollout.rollout_id, attempt_id=attempt.attempt_id, value=1.0))


@pytest.mark.slow  # pays for the session's bootstrap when run first
def test_new_evidence_cuts_a_partition_and_the_cursor_advances(bootstrapped):
    p = pipeline_for()
    instance = dg.DagsterInstance.ephemeral()

    # First tick: the task pool was never seen -> a snapshot is cut and a run requested for it.
    first = _tick(p, instance)
    assert isinstance(first, dg.SensorResult)
    (add,) = first.dynamic_partitions_requests
    (key,) = add.partition_keys
    assert (
        add.partitions_def_name == snapshots.name
        and SNAPSHOT_KEY_PATTERN.match(key)
        and key.startswith("snap-")
    )
    (request,) = first.run_requests
    assert request.partition_key == key and request.run_key == key
    manifest = load_manifest(p, key)
    assert key.endswith(manifest.digest[:8]) and manifest.content_hash == f"sha256:{manifest.digest}"
    cursor = json.loads(first.cursor)
    assert set(cursor) == {"serve_after", "pool"}

    # Nothing new: a skip that says what it waits for; the cursor stays.
    idle = _tick(p, instance, first.cursor)
    assert not idle.run_requests and "0 of 3" in idle.skip_reason.skip_message
    assert idle.cursor == first.cursor

    # Enough rewarded serve rollouts: a new snapshot holding them, and the watermark moves past them.
    _serve_rollouts(p.get_store(), 3, "sensor-test")
    fresh = _tick(p, instance, first.cursor)
    (key2,) = fresh.dynamic_partitions_requests[0].partition_keys
    assert key2 != key and len(load_manifest(p, key2).serve_rollout_ids) == 3
    assert json.loads(fresh.cursor)["serve_after"] > cursor["serve_after"]
    assert p.get_store().get_flag(PAUSE_FLAG)["state"] == "running"


def test_stop_condition_pauses_with_its_reason(bootstrapped):
    # A registered model with no approved-default: the parent is unavailable, so learning must pause.
    p = pipeline_for(mlflow=MLflowResource(model_name="never-approved-policy"))
    result = _tick(p, dg.DagsterInstance.ephemeral())
    assert isinstance(result, dg.SkipReason)
    assert result.skip_message.startswith("paused: parent unavailable")
    flag = p.get_store().get_flag(PAUSE_FLAG)
    assert flag["state"] == "paused" and "parent unavailable" in flag["reason"]


def _nightly(p, instance, when):
    with dg.build_schedule_context(
        instance=instance, resources={"pipeline": p}, scheduled_execution_time=when
    ) as context:
        return nightly_snapshot(context)


def test_nightly_schedule_cuts_a_snapshot_and_requests_its_run(bootstrapped):
    p = pipeline_for()
    with dg.instance_for_test() as instance:
        request = _nightly(p, instance, dt.datetime(2026, 11, 30, 3, 0, tzinfo=dt.UTC))
        # The schedule adds the partition itself (a schedule cannot return partition requests).
        added = instance.get_dynamic_partitions(snapshots.name)
    assert isinstance(request, dg.RunRequest)
    key = request.partition_key
    assert SNAPSHOT_KEY_PATTERN.match(key) and key.startswith("snap-20261130T0300Z-")
    assert added == [key]
    assert request.run_key == key and request.tags["trigger"] == "nightly_snapshot"


def test_nightly_schedule_skips_with_the_reason_while_paused(bootstrapped):
    p = pipeline_for(mlflow=MLflowResource(model_name="never-approved-policy"))
    with dg.instance_for_test() as instance:
        result = _nightly(p, instance, dt.datetime(2026, 11, 30, 3, 0, tzinfo=dt.UTC))
        assert instance.get_dynamic_partitions(snapshots.name) == []
    assert isinstance(result, dg.SkipReason) and result.skip_message.startswith("paused: parent unavailable")


def _alias_tick(p, instance, cursor=None):
    with dg.build_sensor_context(instance=instance, resources={"pipeline": p}, cursor=cursor) as context:
        return approved_alias_sensor(context)


def test_alias_watch_restores_a_moved_alias_and_observes_the_incident(embedded_home, tmp_path):
    from lightning_dagster.engine import build_base_model
    from lightning_dagster.harnesses.registry import training_corpus
    from lightning_dagster.pipeline.context import registry
    from lightning_dagster.registry import APPROVED
    from lightning_dagster.registry.lineage import register_version

    p = pipeline_for(mlflow=MLflowResource(model_name="alias-watch-policy"))
    reg = registry(p)
    base = build_base_model(tmp_path / "base", corpus=training_corpus(seed=0), seed=0)
    parent = reg.register_initial_parent(base)
    other = register_version(reg, base, run_name="never-approved", tags={}, params={})
    mlflow = MlflowClient(reg.tracking_uri, reg.tracking_uri)
    with dg.instance_for_test() as instance:
        quiet = _alias_tick(p, instance)
        assert not quiet.asset_events and quiet.skip_reason.skip_message.endswith("MLflow alias agrees")
        verified_at = json.loads(quiet.cursor)["verified_at"]

        mlflow.set_registered_model_alias(reg.model_name, APPROVED, other.version)
        found = _alias_tick(p, instance, quiet.cursor)

    assert str(mlflow.get_registered_model(reg.model_name).aliases[APPROVED]) == parent.version
    (observation,) = found.asset_events
    assert isinstance(observation, dg.AssetObservation) and observation.asset_key == dg.AssetKey(
        "release_receipt"
    )
    meta = observation.metadata
    assert meta["found_version"].value == other.version and meta["store_version"].value == parent.version
    assert meta["restored"].value is True and meta["moved_by"].value == "unknown"
    (incident,) = reg.incidents()
    assert incident.found_version == other.version and incident.not_before == verified_at
    assert json.loads(found.cursor)["verified_at"] > verified_at
