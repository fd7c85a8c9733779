"""A lineage run's dataset inputs: the frozen task sets a candidate was trained and judged on, as MLflow
datasets (name, digest, schema of their rows, row count, and the file they were read from)."""

from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from lightning_dagster.project.examples import example_tasks
from lightning_dagster.registry import ensure_tracking_store
from lightning_dagster.registry.lineage import DIGEST_CHARS, SnapshotRef, log_lineage_run


@pytest.fixture
def client(tmp_path) -> MlflowClient:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ensure_tracking_store(uri)
    return MlflowClient(uri)


def test_snapshots_become_dataset_inputs_with_the_schema_of_their_rows(client, tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "weights.bin").write_bytes(b"\0")
    train = example_tasks("ledger").draw("train", 3, 0)
    tasks_file = tmp_path / "proj" / "tasks.jsonl"
    snapshots = [
        (
            SnapshotRef("snap-1/train", "sha256:" + "ab" * 32, 3, tuple(train), tasks_file.as_uri()),
            "training",
        ),
        (SnapshotRef("snap-1/holdout", "sha256:" + "cd" * 32, 40), "evaluation"),
    ]
    experiment = client.create_experiment("lineage")
    run_id = log_lineage_run(
        client,
        experiment,
        run_name="candidate-snap-1",
        checkpoint_dir=checkpoint,
        params={},
        tags={},
        snapshots=snapshots,
    ).run_id
    inputs = {d.dataset.name: d for d in client.get_run(run_id).inputs.dataset_inputs}
    assert set(inputs) == {"snap-1/train", "snap-1/holdout"}
    trained = inputs["snap-1/train"]
    assert trained.dataset.digest == ("ab" * 32)[:DIGEST_CHARS] and len(trained.dataset.digest) == 36
    assert [(t.key, t.value) for t in trained.tags] == [("mlflow.data.context", "training")]
    schema = {c["name"]: c["type"] for c in json.loads(trained.dataset.schema)["mlflow_colspec"]}
    assert schema["question"] == "string" and schema["accounts"] == "object" and schema["target"] == "long"
    assert json.loads(trained.dataset.profile) == {"num_rows": 3}
    assert trained.dataset.source_type == "lightning-dagster-snapshot"
    assert json.loads(trained.dataset.source) == {
        "snapshot": "snap-1/train",
        "content_hash": "sha256:" + "ab" * 32,
        "uri": tasks_file.as_uri(),
    }
    # Without its rows a snapshot is still an input: its count and hash, no schema.
    held = inputs["snap-1/holdout"].dataset
    assert json.loads(held.profile) == {"num_rows": 40} and held.schema is None
    assert "uri" not in json.loads(held.source)


def test_a_snapshot_whose_records_disagree_with_its_row_count_is_refused():
    with pytest.raises(ValueError, match="2 rows but 1 records"):
        SnapshotRef.of({"name": "s", "content_hash": "sha256:00", "rows": 2, "records": [{"task_id": "a"}]})
