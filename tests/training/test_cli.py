"""`lightning-dagster train ... --json` prints the held-out result object and registers the candidate."""

from __future__ import annotations

import json
import re

import pytest

from lightning_dagster.cli import main
from lightning_dagster.settings import ServingSettings, TrainingSettings
from lightning_dagster.store import Store
from lightning_dagster.types import RolloutKind

KEYS = {"parent_success", "candidate_success", "parent_greedy", "candidate_greedy", "heldout_tasks", "steps",
        "seconds"}  # fmt: skip


def test_train_json_prints_parent_and_candidate_success(tmp_path, base_model_dir, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    url = f"sqlite:///{tmp_path / 'store.db'}"
    argv = ["train", "--harness", "calc", "--parent", str(base_model_dir), "--steps", "1", "--group-size", "2",
            "--tasks-per-step", "2", "--holdout-tasks", "4", "--store-url", url, "--json", "--parallel", "4",
            "--loss-normalization", "constant", "--loss-constant", "64", "--kl-coef", "0.25",
            "--validation-tasks", "3", "--validation-every", "1", "--validation-patience", "0"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= out.keys() and out["heldout_tasks"] == 4 and out["steps"] == 1 and out["seconds"] > 0
    store = Store(url)
    # each printed success is the mean reward of that evaluation's 4 sampled held-out rollouts
    for key, tag in (("parent_success", "rl-eval0"), ("candidate_success", "rl-eval1")):
        ids = [r.rollout_id for r in store.query_rollouts(kind=RolloutKind.holdout)
               if re.fullmatch(rf"{tag}-g\d", r.group_id)]  # fmt: skip
        assert len(ids) == 4
        assert out[key] == pytest.approx(sum(r.value for r in store.list_rewards(rollout_ids=ids)) / 4)
    (candidate,) = [r for r in store.list_resources() if r.metadata.get("role") == "rl_candidate"]
    assert candidate.resource_id == out["candidate_resource_id"] and candidate.weights_hash
    # the settings it ran with, each given flag's value and every other setting's one default
    training, serving = candidate.metadata["training"], candidate.metadata["serving"]
    assert training == TrainingSettings(
        steps=1, group_size=2, tasks_per_step=2, holdout_tasks=4, loss_normalization="constant",
        loss_constant=64.0, kl_coef=0.25, validation_tasks=3, validation_every=1, validation_patience=0,
    ).model_dump(include=set(training))  # fmt: skip
    assert serving == {**ServingSettings(parallel=4).model_dump(include=set(serving))}
    assert "secret" not in serving and "protected_tasks" not in training
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
    """A bad value is one line naming the flag, exit 2, before anything is loaded."""
    for argv, said in (
        (["--steps", "0"], "--steps: Input should be greater than or equal to 1"),
        (["--group-size", "1"], "--group-size: RL needs groups of 2 or more rollouts per task"),
        (["--kl-coef", "-1"], "--kl-coef: Input should be greater than or equal to 0"),
        (["--validation-every", "0"], "--validation-every: Input should be greater than or equal to 1"),
        (["--parallel", "-1"], "--parallel: Input should be greater than or equal to 0"),
        (["--store-url", "sqlite://", "--learning-rate", "nan"], "--learning-rate: Input should be a finite number"),
        # Dr. GRPO needs its constant: a rule between two settings, both flags named
        (["--loss-normalization", "constant"], "--loss-normalization constant, --loss-constant None: "
         "normalization 'constant' needs a positive finite `constant`"),
    ):  # fmt: skip
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: train: ") and said in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as exited:  # a value outside a setting's choices: argparse's own line
        main(["train", "--loss-normalization", "sum"])
    assert exited.value.code == 2 and "invalid choice: 'sum'" in capsys.readouterr().err


def test_rank_argv_passes_every_given_flag_on_but_nproc():
    """What each rank of `train --nproc N` runs: the same settings, parsed the same way."""
    import argparse

    from lightning_dagster.training.cli import register, settings_of

    parser = argparse.ArgumentParser()
    register(parser)
    given = ["--harness", "calc", "--steps", "3", "--nproc", "2", "--loss-constant", "none",
             "--no-engine-process", "--store-url", "sqlite://", "--json", "--attempt-timeout-s", "30"]  # fmt: skip
    args = parser.parse_args(given)
    rank = args.rank_argv(args)
    assert rank[0] == "train" and "--nproc" not in rank
    again = parser.parse_args(rank[1:])
    first, second = settings_of(args), settings_of(again)
    assert second[0] == first[0].updated({"nproc": 1}) and second[1:] == first[1:]
    assert again.harness == "calc" and again.json and not second[1].engine_process
    assert second[0].given() == {"steps": 3, "loss_constant": None, "attempt_timeout_s": 30.0}


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
    argv = ["train", "--project", str(project), "--parent", str(base_model_dir), "--steps", "1", "--group-size",
            "2", "--tasks-per-step", "2", "--holdout-tasks", "4", "--store-url", url, "--json"]  # fmt: skip
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


# One chat call, then reward 0 (every group's rewards equal); a task with answer 1 fails, saying why on stderr.
FLAT_AGENT = """
import json, os, sys, urllib.request
task = json.loads(os.environ["LD_TASK"])
if task["answer"] == 1:
    sys.exit("boom: this agent has no tool for " + task["task_id"])
def post(url, body):
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    return urllib.request.urlopen(req).read()
post(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
     {"model": "anything", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
post(os.environ["AGL_EVENT_URL"], {"event_type": "reward", "data": {"value": 0.0}})
"""


def test_train_says_each_failure_and_warns_of_a_step_without_learning_signal_on_stderr(
    tmp_path, base_model_dir, monkeypatch, capsys
):
    from tests.project.helpers import task_rows, write_jsonl

    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    project = tmp_path / "flat"
    project.mkdir()
    (project / "agent.py").write_text(FLAT_AGENT)
    write_jsonl(project / "tasks.jsonl", [r for r in task_rows(2) if r["split"] in ("train", "holdout")])
    (project / "lightning-dagster.yaml").write_text(
        json.dumps({"name": "flat", "harness": {"command": ["python", "agent.py"]}, "tasks": {"path": "tasks.jsonl"}})
    )
    argv = ["train", "--project", str(project), "--parent", str(base_model_dir), "--steps", "1", "--group-size",
            "2", "--tasks-per-step", "2", "--holdout-tasks", "2", "--validation-tasks", "0",
            "--store-url", f"sqlite:///{tmp_path / 'store.db'}", "--json"]  # fmt: skip
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["steps"] == 1  # stdout: the result alone; the progress went to stderr
    assert '"step": 1' in err
    lines = err.splitlines()
    failed = [line for line in lines if line.startswith("failed: exit_nonzero in 2 rollout(s), e.g. ")]
    assert failed and "'boom: this agent has no tool for train-1'" in failed[0]
    assert f"(files: {tmp_path / 'home' / 'attempts'}/" in failed[0]
    assert (
        "warning: step 1 had no learning signal: in each of its 1 group(s) every rollout got the same reward "
        "(mean 0.000), so every group was skipped; no weight changed"
    ) in lines
