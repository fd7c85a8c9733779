"""What a user finds in the MLflow UI: a classic ML experiment, a training run timed over the training with
a correct plot, and model versions whose tags (verdict, receipt version and hash, approved flag) agree with
the receipt ledger and the store's pointer after a promotion and after a rollback."""

from __future__ import annotations

import json
import time

import pytest
from mlflow import MlflowClient

from lightning_dagster.gate import PROMOTE, ReceiptLedger, evaluate, load_policy
from lightning_dagster.gate.receipt import with_gate_record
from lightning_dagster.registry import APPROVED, links, receipt_tags
from lightning_dagster.registry.lineage import plot_series
from lightning_dagster.registry.pointers import APPROVED_FLAG
from lightning_dagster.registry.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG
from lightning_dagster.release import promotion, rollbacks
from tests.registry.helpers import approve, candidate_kwargs, passing_receipt, signed_rollback


def test_the_training_plot_draws_the_trainers_reward_mean_and_loss():
    # Rows as `Trainer.step` returns them: `reward_mean` at every step, `success` only from step 2 on.
    rows = [
        {"step": 1, "reward_mean": 0.25, "loss": 0.9, "rows": 64},
        {"step": 3, "reward_mean": 0.5, "loss": 0.7, "success": 0.5},
        {"step": 2, "reward_mean": 0.375, "loss": 0.8, "success": 0.4},
    ]
    assert plot_series(rows) == {
        "reward_mean": [(1, 0.25), (2, 0.375), (3, 0.5)],
        "loss": [(1, 0.9), (2, 0.8), (3, 0.7)],
    }
    assert plot_series([{"step": 1, "loss": 0.5}])["reward_mean"] == []


def test_a_candidate_run_spans_its_training_and_is_filed_as_a_training_run(registry, variant, tracking):
    parent = registry.register_initial_parent(variant(0))
    ended = time.time() - 5
    started = ended - 161.0
    cand = registry.log_candidate(
        variant(1), **candidate_kwargs(parent.version), started_at=started, ended_at=ended
    )
    client = MlflowClient(tracking.uri, tracking.uri)
    run = client.get_run(cand.run_id)
    assert (run.info.start_time, run.info.end_time) == (round(started * 1000), round(ended * 1000))
    assert run.info.status == "FINISHED"
    # MLflow 3 files a run with a model output as a training run; the logged model names the version.
    (output,) = run.outputs.model_outputs
    assert output.step == 2  # the last training step of candidate_kwargs' curve
    model = client.get_logged_model(output.model_id)
    assert model.source_run_id == cand.run_id and model.tags["weights_hash"] == cand.weights_hash
    assert json.loads(model.tags["mlflow.modelVersions"]) == [
        {"name": registry.model_name, "version": cand.version}
    ]
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"
    with pytest.raises(ValueError, match="together"):
        registry.log_candidate(variant(2), **candidate_kwargs(parent.version), started_at=started)
    with pytest.raises(ValueError, match="ends"):
        registry.log_candidate(
            variant(2), **candidate_kwargs(parent.version), started_at=ended, ended_at=started
        )


def test_an_experiment_made_before_the_kind_existed_is_tagged_on_connect(make_registry, tracking):
    reg = make_registry()
    reg.experiment_name = f"old-{reg.model_name}"
    client = MlflowClient(tracking.uri, tracking.uri)
    location = None if reg.artifact_root is None else reg.artifact_root.resolve().as_uri()
    experiment_id = client.create_experiment(reg.experiment_name, artifact_location=location)
    reg.connect()
    assert reg.experiment_id == experiment_id
    assert client.get_experiment(experiment_id).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND


def test_ui_links_open_the_classic_ml_view_of_a_run_and_a_version(registry, monkeypatch):
    ui = "http://127.0.0.1:5000/"
    assert links.run_url(ui, "7", "abc123") == (
        "http://127.0.0.1:5000/#/experiments/7/runs/abc123?workflowType=machine_learning"
    )
    assert links.model_version_url(ui, "my policy", 3) == (
        "http://127.0.0.1:5000/#/models/my%20policy/versions/3?workflowType=machine_learning"
    )
    assert links.experiment_url(ui, "7") == (
        "http://127.0.0.1:5000/#/experiments/7/runs?workflowType=machine_learning"
    )
    monkeypatch.delenv(links.UI_URL_ENV, raising=False)
    assert links.ui_url("sqlite:////tmp/mlflow.db") == links.DEFAULT_UI_URL == "http://127.0.0.1:5000"
    assert links.ui_url("http://mlflow.internal:8080/") == "http://mlflow.internal:8080"
    monkeypatch.setenv(links.UI_URL_ENV, "https://mlflow.example.org/")
    assert links.ui_url("http://mlflow.internal:8080") == "https://mlflow.example.org"
    assert registry.ui_links("abc123", "3") == {
        "mlflow_run": f"https://mlflow.example.org/#/experiments/{registry.experiment_id}/runs/abc123"
        "?workflowType=machine_learning",
        "mlflow_model_version": f"https://mlflow.example.org/#/models/{registry.model_name}/versions/3"
        "?workflowType=machine_learning",
    }
    monkeypatch.setenv(links.UI_URL_ENV, "")
    assert registry.ui_links("abc123", "3") == {}


def _mlflow_view(client: MlflowClient, reg, version: str) -> dict[str, str]:
    tags = client.get_model_version(reg.model_name, version).tags
    return {
        k: tags.get(k, "")
        for k in ("verdict", "receipt_id", "receipt_version", "receipt_hash", APPROVED_FLAG)
    }


def _flagged(client: MlflowClient, reg) -> list[str]:
    found = client.search_model_versions(f"name='{reg.model_name}' and tags.{APPROVED_FLAG} = 'true'")
    return sorted(str(v.version) for v in found)


def test_version_tags_the_ledger_and_the_pointer_agree_after_promotion_and_rollback(
    registry, variant, approver_keys, tracking
):
    client = MlflowClient(tracking.uri, tracking.uri)
    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))
    receipt = passing_receipt(registry, parent, cand, "rec-tags", approver_keys)
    judged = with_gate_record(receipt, evaluate(receipt, load_policy(None)).to_record())
    assert judged.gate.verdict == PROMOTE
    assert _flagged(client, registry) == [parent.version]

    # The approval is ledger version 2 (version 1 is the judged receipt): the tags name version 2.
    approve(registry, judged, approver_keys, "alice")
    ledger = ReceiptLedger(registry.store)
    head = ledger.history("rec-tags")[-1]
    assert head.version == 2
    assert _mlflow_view(client, registry, cand.version) == {
        "verdict": PROMOTE,
        "receipt_id": "rec-tags",
        "receipt_version": "2",
        "receipt_hash": head.content_hash,
        APPROVED_FLAG: "",
    }

    result = promotion.promote(registry, "rec-tags", "alice", key=approver_keys["alice"])
    assert result.mirrored, result.mirror_error
    move = registry.history()[-1]
    recorded = json.loads(move.note)
    head = ledger.history("rec-tags")[-1]
    assert (move.to_value, registry.current(APPROVED)) == (cand.version, cand.version)
    assert (recorded["receipt_version"], recorded["receipt_hash"]) == (head.version, head.content_hash)
    assert _mlflow_view(client, registry, cand.version) == {
        "verdict": ledger.head("rec-tags").gate.verdict,
        "receipt_id": move.receipt_id,
        "receipt_version": str(head.version),
        "receipt_hash": head.content_hash,
        APPROVED_FLAG: "true",
    }
    assert _mlflow_view(client, registry, parent.version)[APPROVED_FLAG] == "false"
    assert _flagged(client, registry) == [cand.version]
    model = client.get_registered_model(registry.model_name)
    assert str(model.aliases[APPROVED]) == cand.version
    assert model.description.startswith(f"{APPROVED}: version {cand.version} (promotion by alice")

    rollbacks.rollback(registry, signed_rollback(registry, parent.version, "alice", approver_keys))
    assert registry.current(APPROVED) == parent.version == registry.history()[-1].to_value
    assert _flagged(client, registry) == [parent.version]
    after = _mlflow_view(client, registry, cand.version)
    # The rolled-back version keeps the receipt that judged it (the ledger did not change), unflagged.
    assert ledger.history("rec-tags")[-1] == head
    assert after == {
        "verdict": PROMOTE,
        "receipt_id": "rec-tags",
        "receipt_version": str(head.version),
        "receipt_hash": head.content_hash,
        APPROVED_FLAG: "false",
    }
    assert client.get_registered_model(registry.model_name).description.startswith(
        f"{APPROVED}: version {parent.version} (rollback by alice"
    )


def test_a_receipt_naming_other_weights_does_not_tag_the_version(registry, variant, approver_keys):
    from lightning_dagster.registry import WeightsMismatch

    parent = registry.register_initial_parent(variant(0))
    cand = registry.log_candidate(variant(1), **candidate_kwargs(parent.version))

    def other_weights(data):
        data["candidate"]["weights_hash"] = "sha256:" + "0" * 64

    receipt = passing_receipt(registry, parent, cand, "rec-other", edit=other_weights)
    ReceiptLedger(registry.store).append(receipt)
    with pytest.raises(WeightsMismatch):
        receipt_tags.write(registry, "rec-other")
    assert (
        "receipt_id"
        not in MlflowClient(registry.tracking_uri).get_model_version(registry.model_name, cand.version).tags
    )


def test_metadata_keeps_mlflow_pages_relative_and_links_follow_the_ui_address_read_now(registry):
    """What a materialization keeps (ids and paths) names no UI address; the link is built from whichever
    address is configured when it is read, so an MLflow UI moved to another port is still reached."""
    from lightning_dagster.pipeline.report import mlflow_links

    kept = mlflow_links(registry, "abc123", "3")
    assert kept["mlflow_run_id"] == "abc123" and kept["mlflow_version"] == "3"
    assert all("://" not in str(v) and "5000" not in str(v) for v in kept.values()), kept
    for ui in ("http://127.0.0.1:5000", "https://mlflow.example.org:8443/"):
        assert links.resolve(ui, kept["mlflow_run_path"]) == links.run_url(
            ui, str(registry.experiment_id), "abc123"
        )
        assert links.resolve(ui, kept["mlflow_model_version_path"]) == links.model_version_url(
            ui, registry.model_name, "3"
        )
