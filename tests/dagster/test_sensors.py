"""Sensor ticks with `dg.build_sensor_context`: new evidence cuts a partition and requests a run, a stop
condition pauses as a recorded decision (condition and receipt) that only an authorized signed resume or a
clearing receipt lifts, the watermark cursor advances, and the alias watch restores an MLflow alias moved
behind the registry's back."""

from __future__ import annotations

import datetime as dt
import json

import dagster as dg
import pytest
from mlflow import MlflowClient

from lightning_dagster.orchestration.jobs import restore_approved_alias
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import MLflowResource
from lightning_dagster.orchestration.sensors import (
    approved_alias_sensor,
    continual_learning_sensor,
    nightly_snapshot,
)
from lightning_dagster.pipeline import loop_history
from lightning_dagster.pipeline.context import StageMissing
from lightning_dagster.pipeline.snapshots import SNAPSHOT_KEY_PATTERN, freeze_tasks, load_manifest
from lightning_dagster.types import AttemptState, Reward
from tests.dagster.conftest import pipeline_for, resume_loop


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
    resume_loop(p)  # a receipt judged earlier in the session's store may have paused it
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
    # The tick wrote nothing: its run's `tasks` freezes what the cut decided, under the key's digest.
    with pytest.raises(StageMissing):
        load_manifest(p, key)
    cut = request.run_config["ops"]["tasks"]["config"]
    manifest = freeze_tasks(p, key, cut)
    assert key.endswith(manifest.digest[:8]) and manifest.content_hash == f"sha256:{manifest.digest}"
    assert manifest.train_seed == cut["train_seed"] and load_manifest(p, key) == manifest
    cursor = json.loads(first.cursor)
    assert set(cursor) == {"serve_after", "pool", "decision"}

    # Nothing new: a skip that says what it waits for; the cursor stays.
    idle = _tick(p, instance, first.cursor)
    assert not idle.run_requests and "0 of 3" in idle.skip_reason.skip_message
    assert idle.cursor == first.cursor

    # Enough rewarded serve rollouts: a new snapshot holding them, and the watermark moves past them.
    _serve_rollouts(p.get_store(), 3, "sensor-test")
    fresh = _tick(p, instance, first.cursor)
    (key2,) = fresh.dynamic_partitions_requests[0].partition_keys
    cut2 = fresh.run_requests[0].run_config["ops"]["tasks"]["config"]
    assert key2 != key and len(freeze_tasks(p, key2, cut2).serve_rollout_ids) == 3
    assert json.loads(fresh.cursor)["serve_after"] > cursor["serve_after"]
    assert loop_history.current_pause(p.get_store()) is None


def test_a_parent_that_is_not_set_pauses_with_its_reason_and_records_nothing(bootstrapped):
    # A registered model with no approved-default: the parent is unavailable, so learning must pause; the
    # pause lifts when the parent is set (a judged receipt records pauses, the sensor only reads).
    p = pipeline_for(mlflow=MLflowResource(model_name="never-approved-policy"))
    before = len(loop_history.history(p.get_store()))
    result = _tick(p, dg.DagsterInstance.ephemeral())
    assert not result.run_requests
    assert result.skip_reason.skip_message.startswith(
        "paused: parent unavailable: approved-default is not set"
    )
    assert "lifts when it no longer holds" in result.skip_reason.skip_message
    assert len(loop_history.history(p.get_store())) == before


def test_a_snapshot_whose_tasks_changed_after_the_cut_is_refused_by_name(bootstrapped, tmp_path):
    from lightning_dagster.pipeline.snapshots import SnapshotTampered

    p = pipeline_for()
    (request,) = _tick(p, dg.DagsterInstance.ephemeral()).run_requests
    cut = request.run_config["ops"]["tasks"]["config"]
    with pytest.raises(SnapshotTampered, match="changed after it was cut"):
        freeze_tasks(p, request.partition_key[:-8] + "00000000", cut)


def _judged(p, instance, key: str, name: str) -> str:
    """A gate fixture receipt (`tests/gate`) as snapshot `key`'s judged receipt, as if made by hand, and the
    loop decision it makes recorded as the stage that judges receipts records it."""
    from lightning_dagster.gate.checks import evaluate
    from lightning_dagster.gate.receipt import parse_receipt, with_gate_record
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.pipeline.triggers import stop_decision
    from tests.gate.conftest import raw

    data = raw(name)
    data["receipt_id"] = ctx.receipt_id(key)
    receipt = parse_receipt(data)
    ctx.append_receipt(
        p.get_store(), key, with_gate_record(receipt, evaluate(receipt, ctx.policy(p)).to_record())
    )
    stop_decision(p, list(instance.get_dynamic_partitions(snapshots.name)), record=True)
    return receipt.receipt_id


def _resume_job(p, request) -> bool:
    from lightning_dagster.orchestration.jobs import resume

    result = resume.execute_in_process(
        run_config={"ops": {"resume_loop": {"config": request.model_dump(mode="json")}}},
        resources={"pipeline": p},
        raise_on_error=False,
    )
    return result.success


@pytest.mark.slow
def test_a_paused_loop_resumes_only_by_an_authorized_signed_decision_or_a_clearing_receipt(
    bootstrapped, monkeypatch
):
    from lightning_dagster.cli import main
    from lightning_dagster.demo import approver_keys
    from lightning_dagster.release.pauses import ResumeRequest

    p = pipeline_for()
    store, instance = p.get_store(), dg.DagsterInstance.ephemeral()
    keys_dir = approver_keys()
    resume_loop(p)  # in case an earlier test of the session's store left it paused
    start = len(loop_history.history(store))
    keys = ["snap-pause-1", "snap-pause-2", "snap-pause-3"]

    # A receipt with a protected regression: the tick pauses, naming the condition and the receipt.
    instance.add_dynamic_partitions(snapshots.name, keys[:1])
    regressed = _judged(p, instance, keys[0], "c")
    paused = _tick(p, instance)
    assert not paused.run_requests and paused.skip_reason.skip_message.startswith(
        "paused: protected set regressed"
    )
    pause = loop_history.current_pause(store)
    assert pause.decision.receipt_id == regressed and pause.decision.by == "gate"
    assert paused.asset_events[0].metadata["receipt_id"].value == regressed

    reason = ["--reason", "regression reviewed"]
    # Unsigned, by an actor without the role, or signed with another actor's key: refused, still paused.
    unsigned = ResumeRequest(actor="bob", role="default-approver", reason="x", at=1.0, pause_hash=pause.hash)
    assert not _resume_job(p, unsigned)
    assert (
        main(
            [
                "loop",
                "resume",
                "--actor",
                "alice",
                "--role",
                "release-owner",
                "--key",
                str(keys_dir / "alice.key"),
                *reason,
            ]
        )
        == 1
    )
    assert main(["loop", "resume", "--actor", "bob", "--key", str(keys_dir / "alice.key"), *reason]) == 1
    still = _tick(p, instance, paused.cursor)  # the pause was shown once
    assert still.skip_reason.skip_message.startswith("paused:") and not still.asset_events
    assert loop_history.current_pause(store).hash == pause.hash

    # Bob, a default-approver, signs (`loop sign`) and the resume job records it: the loop learns again.
    signed = loop_history.sign_resume(
        store, actor="bob", role="default-approver", key=keys_dir / "bob.key", reason="ok"
    )
    assert _resume_job(p, signed)
    running = _tick(p, instance)
    assert running.run_requests and loop_history.current_pause(store) is None

    # A newer receipt with the same condition pauses again; a newer one made by hand that clears it resumes.
    instance.add_dynamic_partitions(snapshots.name, keys[1:2])
    _judged(p, instance, keys[1], "c")
    assert _tick(p, instance).skip_reason.skip_message.startswith("paused: protected set regressed")
    instance.add_dynamic_partitions(snapshots.name, keys[2:])
    clearing = _judged(p, instance, keys[2], "a")
    cleared = _tick(p, instance)
    assert cleared.asset_events[0].metadata["loop_decision"].value == "resume"

    history = [
        (r.decision.action, r.decision.by, r.decision.receipt_id) for r in loop_history.history(store)[start:]
    ]
    assert history == [
        ("pause", "gate", regressed),
        ("resume", "actor", regressed),
        ("pause", "gate", "rcpt-snap-pause-2"),
        ("resume", "receipt", clearing),
    ]
    assert loop_history.history(store)[start + 1].decision.actor == "bob"
    monkeypatch.setenv("LD_STORE_URL", store.url)
    assert main(["loop", "history", "--json"]) == 0


def _nightly(p, instance, when):
    with dg.build_schedule_context(
        instance=instance, resources={"pipeline": p}, scheduled_execution_time=when
    ) as context:
        return nightly_snapshot(context)


def test_nightly_schedule_cuts_a_snapshot_and_requests_its_run(bootstrapped):
    p = pipeline_for()
    resume_loop(p)
    with dg.instance_for_test() as instance:
        request = _nightly(p, instance, dt.datetime(2026, 11, 30, 3, 0, tzinfo=dt.UTC))
        # The schedule adds the partition itself (a schedule cannot return partition requests).
        added = instance.get_dynamic_partitions(snapshots.name)
    assert isinstance(request, dg.RunRequest)
    key = request.partition_key
    assert SNAPSHOT_KEY_PATTERN.match(key) and key.startswith("snap-20261130T0300Z-")
    assert added == [key]
    assert request.run_key == key and request.tags["trigger"] == "nightly_snapshot"


def test_nightly_schedule_skips_with_the_reason_while_paused(bootstrapped, leaves_loop_running):
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
    from lightning_dagster.harnesses.corpus import training_corpus
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
        # The tick only asks for the restore: nothing changed yet, nothing recorded.
        assert str(mlflow.get_registered_model(reg.model_name).aliases[APPROVED]) == other.version
        assert reg.incidents() == [] and not found.asset_events
        (request,) = found.run_requests
        assert request.run_config["ops"]["restore_alias"]["config"]["last_verified"] == verified_at
        assert _alias_tick(p, instance, quiet.cursor).run_requests[0].run_key == request.run_key  # once

        run = restore_approved_alias.execute_in_process(
            instance=instance, run_config=request.run_config, resources={"pipeline": p}
        )
        (observation,) = [
            e.event_specific_data.asset_observation
            for e in run.all_events
            if e.event_type_value == "ASSET_OBSERVATION"
        ]
        after = _alias_tick(p, instance, quiet.cursor)

    assert str(mlflow.get_registered_model(reg.model_name).aliases[APPROVED]) == parent.version
    assert observation.asset_key == dg.AssetKey("release_receipt")
    meta = observation.metadata
    assert meta["found_version"].value == other.version and meta["store_version"].value == parent.version
    assert meta["restored"].value is True and meta["moved_by"].value == "unknown"
    (incident,) = reg.incidents()
    assert incident.found_version == other.version and incident.not_before == verified_at
    assert not after.run_requests and json.loads(after.cursor)["verified_at"] > verified_at


def test_alias_watch_never_mirrors_a_pointer_moved_in_the_store(embedded_home, tmp_path):
    """The pointer row moved by a direct store edit: the watch reports the broken history (an incident
    naming the row), and MLflow's alias stays on the last verified move; no restore is asked for."""
    import sqlalchemy as sa

    from lightning_dagster.engine import build_base_model
    from lightning_dagster.harnesses.corpus import training_corpus
    from lightning_dagster.pipeline.context import registry
    from lightning_dagster.registry import APPROVED
    from lightning_dagster.registry.lineage import register_version

    p = pipeline_for(mlflow=MLflowResource(model_name="chain-watch-policy"))
    reg = registry(p)
    base = build_base_model(tmp_path / "base", corpus=training_corpus(seed=0), seed=0)
    parent = reg.register_initial_parent(base)
    other = register_version(reg, base, run_name="never-approved", tags={}, params={})
    with reg.store.engine.begin() as c:
        c.execute(
            sa.text("UPDATE pointers SET value = :v WHERE name = :n"),
            {"v": other.version, "n": reg.pointer_name()},
        )
    with dg.instance_for_test() as instance:
        tick = _alias_tick(p, instance)
    assert not tick.run_requests and "history BROKEN (pointer row" in tick.skip_reason.skip_message
    mlflow = MlflowClient(reg.tracking_uri, reg.tracking_uri)
    assert str(mlflow.get_registered_model(reg.model_name).aliases[APPROVED]) == parent.version
    (incident,) = [i for i in reg.incidents() if i.chain]
    assert incident.chain.startswith("pointer row") and incident.store_version == parent.version
