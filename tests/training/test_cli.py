"""`lightning-dagster train ... --json` prints the held-out result object and registers the candidate."""

from __future__ import annotations

import json

from lightning_dagster.cli import main
from lightning_dagster.store import Store

KEYS = {"parent_success", "candidate_success", "parent_greedy", "candidate_greedy", "heldout_tasks", "steps",
        "seconds"}  # fmt: skip


def test_train_json_prints_parent_and_candidate_success(tmp_path, base_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    argv = ["train", "--harness", "calc", "--parent", str(base_model_dir), "--steps", "1", "--group", "2",
            "--tasks-per-step", "2", "--heldout", "4", "--store", url, "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= out.keys() and out["heldout_tasks"] == 4 and out["steps"] == 1
    assert 0.0 <= out["candidate_success"] <= 1.0 and out["seconds"] > 0
    (candidate,) = [r for r in Store(url).list_resources() if r.metadata.get("role") == "rl_candidate"]
    assert candidate.resource_id == out["candidate_resource_id"] and candidate.weights_hash


def test_train_rejects_bad_arguments(capsys):
    assert main(["train", "--steps", "0"]) == 2
    assert "error" in capsys.readouterr().err
