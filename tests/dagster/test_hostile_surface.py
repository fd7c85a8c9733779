"""The Dagster surface used carelessly or with hostile intent: a partition key that is not a snapshot key,
an asset whose upstream never materialized, a corrupt sensor cursor, an unreachable store. Each stops with a
one-line `dg.Failure` (or a named error) and writes nothing."""

from __future__ import annotations

import json

import dagster as dg
import pytest

from lightning_dagster.orchestration.assets import candidate_resource, spans
from lightning_dagster.orchestration.assets import tasks as tasks_asset
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.orchestration.resources import StoreResource
from lightning_dagster.orchestration.sensors import _verified_at
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.snapshots import InvalidSnapshotKey, validate_snapshot_key
from lightning_dagster.pipeline.triggers import InvalidCursor, Watermark
from lightning_dagster.store import Store
from lightning_dagster.store.errors import StoreUnavailable
from tests.dagster.conftest import pipeline_for

UNREACHABLE = "postgresql://ld:secret@127.0.0.1:1/nowhere"  # port 1: refused at once


def _failure(assets, key: str, resources: dict) -> dg.UserFailureData:
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(snapshots.name, [key])
    result = dg.materialize(
        assets, partition_key=key, resources=resources, instance=instance, raise_on_error=False
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    data = failure.step_failure_data
    assert data.error.cls_name == "Failure", data.error.message
    return data.user_failure_data


@pytest.mark.parametrize("key", ["..", ".", "-rf", "_x", "a/../../b", "a,b"])
def test_a_partition_key_that_is_not_a_snapshot_key_is_refused_before_anything_is_written(embedded_home, key):
    """Anyone may add a partition in the UI; `..` named the home's parent folders in every path a stage
    builds from the key (`snapshots/<key>`, `candidates/<key>`)."""
    p = pipeline_for()
    failure = _failure([tasks_asset], key, {"pipeline": p})
    assert failure.description.startswith("tasks refused: snapshot key")
    assert failure.metadata["refused"].value == "InvalidSnapshotKey"
    assert p.get_store().document_versions(ctx.SNAPSHOTS, key) == []
    with pytest.raises(InvalidSnapshotKey):
        validate_snapshot_key(key)
    with pytest.raises(InvalidSnapshotKey):
        ctx.candidate_dir(key)


def test_an_asset_whose_upstream_never_materialized_fails_naming_it(embedded_home):
    p = pipeline_for()
    key = "snap-20261130T0800Z-0000f00d"
    failure = _failure([spans], key, {"pipeline": p})
    assert failure.metadata["error"].value == "StageMissing"
    assert failure.metadata["materialize_first"].value == "update_plan"
    assert "`update_plan` has not been materialized yet" in failure.description
    # No trainer process is started for it either: the asset names what is missing before Pipes runs.
    pipes = dg.PipesSubprocessClient()
    failure = _failure([candidate_resource], key, {"pipeline": p, "trainer_pipes": pipes})
    assert failure.description.startswith(f"candidate_resource of snapshot {key} failed:")
    assert failure.metadata["error"].value == "StageMissing"


def test_an_unreachable_store_is_a_named_failure_not_a_driver_traceback(embedded_home):
    with pytest.raises(StoreUnavailable, match="cannot be reached .*Connection refused"):
        Store(UNREACHABLE)
    p = pipeline_for().model_copy(update={"store": StoreResource(url=UNREACHABLE)})
    failure = _failure([tasks_asset], "snap-20261130T0800Z-0000beef", {"pipeline": p})
    assert failure.metadata["error"].value == "StoreUnavailable"
    assert "cannot be reached" in failure.description and "secret" not in failure.description


@pytest.mark.parametrize(
    "cursor",
    [
        "not json",
        "[1, 2]",
        '{"serve_after": "12.5"}',
        '{"serve_after": NaN}',
        '{"serve_after": 1e308}',
        '{"serve_after": -5}',
        '{"serve_after": 1.0, "pool": 7}',
    ],
)
def test_a_corrupt_continual_learning_cursor_is_named_never_guessed(cursor):
    """From zero the sensor would snapshot serve rollouts earlier snapshots hold; a NaN or far-future mark
    would silently never see a new one."""
    with pytest.raises(InvalidCursor, match="is not a watermark .*dagster sensor cursor"):
        Watermark.from_cursor(cursor)


def test_an_older_continual_learning_cursor_still_reads():
    assert Watermark.from_cursor('{"serve_after": 12.5}') == Watermark(serve_after=12.5)
    mark = Watermark(serve_after=100.0, pool="sha256:abc")
    assert Watermark.from_cursor(mark.to_cursor()) == mark


def test_a_corrupt_alias_cursor_leaves_the_incident_window_open():
    now = 2_000_000_000.0
    assert _verified_at(json.dumps({"verified_at": 1_900_000_000.5}), now) == 1_900_000_000.5
    for cursor in (
        None,
        "",
        "garbage",
        "[1]",
        '{"verified_at": "x"}',
        '{"verified_at": NaN}',
        '{"verified_at": 3e9}',
    ):
        assert _verified_at(cursor, now) is None


def test_a_receipt_brought_in_by_hand_under_a_snapshots_id_does_not_stop_the_sensors(embedded_home):
    """The sensors read every snapshot's receipt; one the pipeline did not write is skipped, not fatal."""
    from lightning_dagster.gate import ReceiptLedger, load_receipt
    from lightning_dagster.pipeline.triggers import _gated
    from tests.registry.helpers import EXAMPLE_RECEIPT

    store, key = pipeline_for().get_store(), "snap-20261130T0800Z-0000f0e1"
    receipt = load_receipt(EXAMPLE_RECEIPT)
    ReceiptLedger(store).append(receipt.model_copy(update={"receipt_id": ctx.receipt_id(key)}))
    with pytest.raises(ctx.ForeignReceipt):
        ctx.find_receipt(store, key)
    assert _gated(store, [key]) == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"actor": "", "at": 1.0}, "actor: String should have at least 1 character"),
        ({"step": "everything", "at": 1.0}, "step: Input should be 'canary' or 'default'"),
        ({"at": float("inf")}, "at: Input should be a finite number"),
    ],
)
def test_approve_job_with_bad_fields_is_refused_in_one_line(embedded_home, fields, named):
    from lightning_dagster.orchestration.jobs import approve

    config = {"snapshot_key": "snap-20261130T0800Z-0000abcd", "actor": "alice", "evidence_hash": "x"}
    config |= {"signature": "y", **fields}
    job = dg.Definitions(jobs=[approve], resources={"pipeline": pipeline_for()}).resolve_job_def("approve")
    result = job.execute_in_process(
        run_config={"ops": {"approve_receipt": {"config": config}}},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    data = failure.step_failure_data
    if fields.get("actor") == "":  # "" is refused by the job's config, naming the field, before the op runs
        error = data.error
        while error.cause is not None:
            error = error.cause
        assert "ApproveConfig\nactor\n  String should have at least 1 character" in error.message
        return
    assert data.error.cls_name == "Failure", data.error.message
    assert data.user_failure_data.description.startswith("approval refused: invalid approval: ")
    assert named in data.user_failure_data.description
    assert data.user_failure_data.metadata["refused"].value == "InvalidInput"


def test_training_a_snapshot_whose_receipt_has_its_candidate_again_is_refused_before_training(embedded_home):
    """A second `candidate_resource` of a finished partition would register another version, move
    latest-candidate and overwrite the checkpoint the receipt's evaluations ran on, then be refused by the
    ledger: it stops first, and the stage's record stays as it was."""
    from lightning_dagster.gate import load_receipt
    from tests.registry.helpers import EXAMPLE_RECEIPT

    p, key = pipeline_for(), "snap-20261130T0800Z-0000ca4d"
    receipt = load_receipt(EXAMPLE_RECEIPT).model_copy(update={"receipt_id": ctx.receipt_id(key)})
    ctx.append_receipt(p.get_store(), key, receipt)
    pipes = dg.PipesSubprocessClient()
    failure = _failure([candidate_resource], key, {"pipeline": p, "trainer_pipes": pipes})
    assert failure.metadata["error"].value == "CandidateRecorded"
    assert f"snapshot {key} already has its candidate (version {receipt.candidate.model_version})" in (
        failure.description
    )
    assert p.get_store().document_versions(ctx.STAGES, f"{key}/candidate_resource") == []


@pytest.mark.parametrize(
    "error",
    [
        "lightning_dagster.training.transitions.TooManyExcludedRollouts",
        "lightning_dagster.pipeline.transitions_file.TokenizerMismatch",
    ],
)
def test_a_refused_first_batch_is_a_one_line_failure_naming_the_error(error):
    """Too many rollouts with an invalid span, or transitions of another tokenizer: the data's fault, named,
    not a traceback of the stage."""
    from importlib import import_module

    from lightning_dagster.orchestration.assets.failures import snapshot_stage

    module, name = error.rsplit(".", 1)
    cls = getattr(import_module(module), name)
    key = "snap-20261130T0800Z-1a2b3c4d"
    with pytest.raises(dg.Failure) as caught, snapshot_stage("training_transitions", key):
        raise cls("2 of 8 rollouts have an invalid span\nand were excluded")
    assert caught.value.description == (
        f"training_transitions of snapshot {key} failed: 2 of 8 rollouts have an invalid span and were excluded"
    )
    assert caught.value.metadata["error"].value == name
