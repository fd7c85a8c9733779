"""Triggers (those that train a model start stopped). A sensor writes nothing itself, so a UI preview
changes nothing: Dagster commits what it decides with the tick."""

import datetime as dt
import json
import time

import dagster as dg

from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.orchestration.assets import release_receipt
from lightning_dagster.orchestration.assets.metadata import to_metadata
from lightning_dagster.orchestration.jobs import continual_learning, restore_approved_alias
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import PipelineResource
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline import triggers
from lightning_dagster.pipeline.triggers import Watermark


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _keys(instance: dg.DagsterInstance) -> list[str]:
    """Snapshot keys in the order they were added (oldest first)."""
    return list(instance.get_dynamic_partitions(snapshots.name))


@dg.sensor(
    job=continual_learning,
    minimum_interval_seconds=60,
    default_status=dg.DefaultSensorStatus.STOPPED,
    description="Cuts a content-hashed snapshot when enough new rewarded serve rollouts or new tasks arrive, "
    "unless the loop is paused: a judged receipt's stop condition pauses it as a decision recorded with the "
    "receipt, lifted by an authorized actor's `resume` job or `lightning-dagster loop resume`, or by a newer "
    "receipt that clears it. Each pause and resume is shown once as an observation on release_receipt.",
)
def continual_learning_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource):
    from lightning_dagster.pipeline.loop_history import decision_metadata

    watermark = Watermark.from_cursor(context.cursor)
    stop = triggers.stop_decision(pipeline, _keys(context.instance))
    observed = []
    if stop.head is not None and stop.head.hash != watermark.decision:
        watermark.decision = stop.head.hash
        observed.append(
            dg.AssetObservation(
                asset_key=release_receipt.key,
                description=f"continual learning {stop.head.decision.action}d",
                metadata=to_metadata(decision_metadata(pipeline.get_store(), stop.head)),
            )
        )
    if stop.pause:
        return dg.SensorResult(
            skip_reason=f"paused: {stop.reason}", cursor=watermark.to_cursor(), asset_events=observed
        )
    evidence = triggers.new_evidence(pipeline, watermark)
    if not evidence.enough:
        return dg.SensorResult(
            skip_reason=f"waiting: {evidence.summary}", cursor=watermark.to_cursor(), asset_events=observed
        )
    cut = triggers.cut_snapshot(pipeline, evidence, _now())
    evidence.watermark.decision = watermark.decision
    return dg.SensorResult(
        dynamic_partitions_requests=[snapshots.build_add_request([cut.key])],
        run_requests=[cut_run(cut, "continual_learning_sensor")],
        cursor=evidence.watermark.to_cursor(),
        asset_events=observed,
    )


def cut_run(cut: triggers.Cut, trigger: str) -> dg.RunRequest:
    """The run of a cut snapshot: its `tasks` freezes what the cut decided."""
    return dg.RunRequest(
        partition_key=cut.key,
        run_key=cut.key,
        run_config={"ops": {"tasks": {"config": cut.config}}},
        tags={"trigger": trigger},
    )


@dg.sensor(
    minimum_interval_seconds=120,
    default_status=dg.DefaultSensorStatus.RUNNING,
    asset_selection=[release_receipt],
    description="Finds receipt checks whose evaluator, tool contract, task distribution or parent changed since "
    "the gate ran (the gate voids them when it judges) and records each such receipt once as an observation on "
    "release_receipt, naming what changed. Writes nothing itself.",
)
def stale_evidence_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource):
    cursor, stale = triggers.stale_receipts(pipeline, _keys(context.instance), context.cursor)
    if not stale:
        return dg.SensorResult(skip_reason="no receipt has stale evidence", cursor=cursor)
    observations = []
    for mark in stale:
        settings = ctx.changed_settings(pipeline, mark.snapshot_key)
        what = "; ".join(f"{name} ({', '.join(diffs)})" for name, diffs in settings.items())
        context.log.info(
            f"{mark.receipt_id} ({mark.snapshot_key}): checks {sorted(map(int, mark.void_checks))} stale"
        )
        observations.append(
            dg.AssetObservation(
                asset_key=release_receipt.key,
                partition=mark.snapshot_key,
                description=f"stale: {what or ', '.join(mark.changed)} changed since the gate ran",
                metadata=to_metadata(
                    {
                        # `stale_checks` as the receipt's own metadata names them, so both agree.
                        "stale": True,
                        "stale_checks": sorted(int(c) for c in mark.void_checks),
                        "void_checks": {str(int(k)): v for k, v in mark.void_checks.items()},
                        "changed": mark.changed,
                        "changed_settings": settings,
                        "receipt_id": mark.receipt_id,
                    }
                ),
            )
        )
    return dg.SensorResult(asset_events=observations, cursor=cursor)


def _verified_at(cursor: str | None, now: float) -> float | None:
    """When the alias was last seen to agree; None (the incident window stays open) for a bad cursor."""
    try:
        seen = json.loads(cursor) if cursor else {}
    except ValueError:
        return None
    at = seen.get("verified_at") if isinstance(seen, dict) else None
    if isinstance(at, bool) or not isinstance(at, int | float) or not 0 < at <= now:
        return None
    return float(at)


@dg.sensor(
    minimum_interval_seconds=30,
    default_status=dg.DefaultSensorStatus.RUNNING,
    job=restore_approved_alias,
    description="Checks every tick that MLflow's approved-default alias names the store's pointer; when it "
    "does not (moved in MLflow's UI, by another client, or a mirror write lost), requests a restore_approved_alias "
    "run, which restores it and records an alias moved outside the registry as an incident. Writes nothing itself.",
)
def approved_alias_sensor(context: dg.SensorEvaluationContext, pipeline: PipelineResource):
    from lightning_dagster.registry.errors import RegistryUnavailable

    checked_at = time.time()
    last_verified = _verified_at(context.cursor, checked_at)
    try:
        rec = ctx.registry(pipeline).reconcile(check_only=True)
    except RegistryUnavailable as exc:
        return dg.SkipReason(f"alias not checked: {exc}")
    broken = rec.chain.problem if rec.chain is not None else None
    if broken:  # recorded as an incident; the mirror shows only the last verified move
        context.log.error(f"approved-default's history does not verify: {broken}")
    if not rec.changed:
        cursor = json.dumps({"verified_at": checked_at, "approved_default": rec.pointer})
        state = (
            f"history BROKEN ({broken}), MLflow shows the last verified move"
            if broken
            else "MLflow alias agrees"
        )
        return dg.SensorResult(
            skip_reason=f"approved-default {rec.pointer or '(unset)'}: {state}", cursor=cursor
        )
    context.log.warning(f"approved-default {rec.pointer}: MLflow differs ({'; '.join(rec.differences)})")
    # One restore per difference seen (and a retry every ten minutes while it persists).
    run_key = f"restore-{content_hash([rec.differences, int(checked_at // 600)])[7:23]}"
    config = {"ops": {"restore_alias": {"config": {"last_verified": last_verified}}}}
    return dg.SensorResult(run_requests=[dg.RunRequest(run_key=run_key, run_config=config)])


@dg.schedule(
    job=continual_learning,
    cron_schedule="0 3 * * *",
    execution_timezone="UTC",
    default_status=dg.DefaultScheduleStatus.STOPPED,
    description="Nightly: cut a snapshot of the current task pool and serve evidence, unless a stop condition holds.",
)
def nightly_snapshot(context: dg.ScheduleEvaluationContext, pipeline: PipelineResource):
    stop = triggers.stop_decision(pipeline, _keys(context.instance))
    if stop.pause:
        return dg.SkipReason(f"paused: {stop.reason}")
    # The schedule has no cursor: it takes every rewarded serve rollout of the last day.
    since = Watermark(serve_after=(context.scheduled_execution_time or _now()).timestamp() - 86400)
    evidence = triggers.new_evidence(pipeline, since, force=True)
    cut = triggers.cut_snapshot(pipeline, evidence, context.scheduled_execution_time or _now())
    # A schedule cannot return partition requests; it adds the partition itself before asking for the run.
    context.instance.add_dynamic_partitions(snapshots.name, [cut.key])
    return cut_run(cut, "nightly_snapshot")
