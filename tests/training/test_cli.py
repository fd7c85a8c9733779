"""`lightning-dagster train ... --json` prints the held-out result object and registers the candidate."""

from __future__ import annotations

import json
import re

import pytest

from lightning_dagster.cli import main
from lightning_dagster.store import Store
from lightning_dagster.types import RolloutKind

KEYS = {"parent_success", "candidate_success", "parent_greedy", "candidate_greedy", "heldout_tasks", "steps",
        "seconds"}  # fmt: skip


def test_train_json_prints_parent_and_candidate_success(tmp_path, base_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    argv = ["train", "--harness", "calc", "--parent", str(base_model_dir), "--steps", "1", "--group", "2",
            "--tasks-per-step", "2", "--heldout", "4", "--store", url, "--json", "--serving", "thread",
            "--loss-normalization", "constant", "--loss-constant", "64", "--kl-coef", "0.25",
            "--validation-tasks", "3", "--validation-every", "1", "--validation-patience", "0"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= out.keys() and out["heldout_tasks"] == 4 and out["steps"] == 1 and out["seconds"] > 0
    store = Store(url)
    # each printed success is the mean reward of that evaluation's 4 sampled held-out rollouts
    for key, tag in (("parent_success", "eval0"), ("candidate_success", "eval1")):
        ids = [r.rollout_id for r in store.query_rollouts(kind=RolloutKind.holdout)
               if re.fullmatch(rf"{tag}-g\d", r.group_id)]  # fmt: skip
        assert len(ids) == 4
        assert out[key] == pytest.approx(sum(r.value for r in store.list_rewards(rollout_ids=ids)) / 4)
    (candidate,) = [r for r in store.list_resources() if r.metadata.get("role") == "rl_candidate"]
    assert candidate.resource_id == out["candidate_resource_id"] and candidate.weights_hash
    rl = candidate.metadata["rl"]
    assert rl["serving"] == "thread" and rl["step"]["group_size"] == 2
    assert (rl["trainer"]["loss"]["normalization"], rl["trainer"]["loss"]["constant"]) == ("constant", 64.0)
    assert rl["trainer"]["loss"]["kl_coef"] == 0.25 and rl["validation"] == {
        "tasks": 3, "every": 1, "patience": 0, "success_threshold": 0.5}  # fmt: skip
    # the one step was judged on 3 validation cases and proposed (nothing else to choose from)
    assert (out["kl_coef"], out["validation_tasks"], out["chosen_step"], out["early_stop"]) == (
        0.25,
        3,
        1,
        None,
    )
    (checkpoint,) = candidate.metadata["selection"]["checkpoints"]
    assert checkpoint["step"] == 1
    assert len(store.query_rollouts(kind=RolloutKind.validation)) == 2 * 3  # the parent and step 1


def test_train_rejects_bad_arguments(capsys):
    assert main(["train", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["train", "--loss-normalization", "constant"]) == 2  # Dr. GRPO needs its constant
    assert "needs a positive finite `constant`" in capsys.readouterr().err
    assert main(["train", "--loss-normalization", "sum"]) == 2
    assert "unknown normalization 'sum'" in capsys.readouterr().err
    assert main(["train", "--kl-coef", "-1"]) == 2
    assert "kl_coef must be a finite number >= 0" in capsys.readouterr().err
    assert main(["train", "--validation-every", "0"]) == 2
    assert "validation every must be >= 1" in capsys.readouterr().err


def test_train_project_samples_its_train_split_and_evaluates_on_its_holdout_split(
    tmp_path, base_model_dir, monkeypatch, capsys
):
    import shutil

    from lightning_dagster.project.examples import example_file, example_tasks

    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    project = tmp_path / "calc-subset"
    project.mkdir()
    shutil.copy(example_file("calc"), project)
    (project / "demos.jsonl").write_text("")  # present for the project file; --parent skips the warm start
    tasks = example_tasks("calc")
    rows = tasks.splits["train"][:3] + tasks.splits["holdout"][:2]
    (project / "tasks.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    argv = ["train", "--project", str(project), "--parent", str(base_model_dir), "--steps", "1", "--group", "2",
            "--tasks-per-step", "2", "--heldout", "4", "--store", url, "--json", "--serving", "thread"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["heldout_tasks"] == 2  # the project's holdout split has 2 rows
    store = Store(url)
    trained = {r.task["task_id"] for r in store.query_rollouts(kind=RolloutKind.train)}
    assert trained and trained <= {row["task_id"] for row in rows[:3]}
    held = {r.task["task_id"] for r in store.query_rollouts(kind=RolloutKind.holdout)}
    assert held == {row["task_id"] for row in rows[3:]}
    # the one train task the run does not train on is its validation split
    validated = {r.task["task_id"] for r in store.query_rollouts(kind=RolloutKind.validation)}
    assert validated == {row["task_id"] for row in rows[:3]} - trained and out["validation_tasks"] == 1


def test_train_with_a_missing_project_file_exits_2_naming_it(tmp_path, capsys):
    assert main(["train", "--project", str(tmp_path / "none")]) == 2
    assert str(tmp_path / "none") in capsys.readouterr().err
