"""The project file: a valid one loads with paths resolved; every bad one is a ProjectError naming the file,
the dotted key and the problem."""

from __future__ import annotations

import os
import sys
from importlib import resources

import pytest

from lightning_dagster.project import PROJECT_FILE, ProjectError, load_project
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.runner.output import DEFAULT_MAX_OUTPUT_BYTES
from lightning_dagster.settings import TrainingSettings
from tests.project.helpers import DELETE, write_project

NOT_EXECUTABLE = "bin/agent.sh"


@pytest.mark.parametrize(
    ("changes", "key", "fragment"),
    [
        ({"name": DELETE}, "name", "missing key"),
        ({"name": "has spaces"}, "name", "should match pattern"),
        ({"harness": DELETE}, "harness", "missing key"),
        ({"tasks": DELETE}, "tasks", "missing key"),
        ({"colour": "blue"}, "colour", "unknown key"),
        ({"harness.timeout": 5}, "harness.timeout", "unknown key"),
        (
            {"harness.python": "hooks:run"},
            "harness",
            "exactly one of command, python, agl (got command, python)",
        ),
        ({"harness.command": DELETE}, "harness", "give exactly one of command, python, agl"),
        ({"harness.command": []}, "harness.command", "needs at least the program"),
        ({"harness.command": ["no-such-program-7f3a"]}, "harness.command", "not found on PATH or in"),
        ({"harness.command": ["./bin/missing"]}, "harness.command", "does not exist"),
        ({"harness.command": [NOT_EXECUTABLE]}, "harness.command", "is not executable"),
        ({"harness.command": "python agent.py"}, "harness.command", "valid tuple"),
        ({"harness.command": ["python", "agent.py", "a\x00b"]}, "harness.command", "NUL character"),
        ({"harness": {"python": "nosuchmodule_7f3a:run"}}, "harness.python", "no module 'nosuchmodule_7f3a'"),
        ({"harness": {"python": "hooks"}}, "harness.python", "expected 'module:function'"),
        ({"harness": {"python": "hooks:missing"}}, "harness.python", "has no attribute 'missing'"),
        ({"harness": {"python": "hooks:VALUE"}}, "harness.python", "is not callable (int)"),
        ({"harness": {"python": "broken:run"}}, "harness.python", "RuntimeError: boom at import"),
        ({"harness": {"agl": "hooks:run"}}, "harness.agl", "not a class with a run() method"),
        ({"harness.prepare": "hooks:nothing"}, "harness.prepare", "has no attribute 'nothing'"),
        ({"harness.verify": "hooks:VALUE"}, "harness.verify", "not callable"),
        ({"training.attempt_timeout_s": 0}, "training.attempt_timeout_s", "greater than 0"),
        ({"training.attempt_timeout_s": float("inf")}, "training.attempt_timeout_s", "finite number"),
        ({"training.max_attempts": 0}, "training.max_attempts", "greater than or equal to 1"),
        ({"training.steps": "many"}, "training.steps", "valid integer"),
        ({"training.lr": 0.1}, "training.lr", "not a training setting; known: seed, steps,"),
        ({"serving.runner_mode": "threads"}, "serving.runner_mode", "'inprocess' or 'subprocess'"),
        (
            {"serving.upstream_url": "localhost:8000"},
            "serving.upstream_url",
            "not an http:// or https:// URL",
        ),
        ({"serving.secret": "s3cret"}, "serving.secret", "not read from a project file"),
        ({"gate.policy_path": "policy.yaml"}, "gate.policy_path", "does not exist"),
        ({"gate.policy_path": "tasks.jsonl"}, "gate.policy_path", "invalid policy"),
        ({"gate.roles_path": "roles.yaml"}, "gate.roles_path", "does not exist"),
        # the canary runs the project's own harness: no setting names another agent for it
        ({"gate.canary_harness": "ledger"}, "gate.canary_harness", "not a gate setting; known: policy_path,"),
        ({"gate.store_url": "sqlite://"}, "gate.store_url", "not a gate setting; known: policy_path,"),
        ({"store": {"url": "sqlite://"}}, "store", "unknown key"),
        # Keys the file had before its settings sections: each names the one that replaced it.
        ({"harness.timeout_s": 5}, "harness.timeout_s", "renamed: give it as training.attempt_timeout_s"),
        ({"harness.max_attempts": 2}, "harness.max_attempts", "renamed: give it as training.max_attempts"),
        (
            {"model": {"upstream": "http://localhost:8000"}},
            "model.upstream",
            "give it as serving.upstream_url",
        ),
        ({"policy": "policy.yaml"}, "policy", "renamed: give it as gate.policy_path"),
        ({"harness.max_output_bytes": 100}, "harness.max_output_bytes", "greater than or equal to 1024"),
        ({"harness.max_output_bytes": "a lot"}, "harness.max_output_bytes", "valid integer"),
        ({"harness.expected_spans": []}, "harness.expected_spans", "at least one"),
        ({"harness.expected_spans": ["llm", "llm"]}, "harness.expected_spans", "twice"),
        ({"harness.env_map": {"1BAD": "question"}}, "harness.env_map", "not environment variable names"),
        ({"tasks.path": "nope.jsonl"}, "tasks.path", "does not exist"),
        ({"tasks.path": DELETE}, "tasks.path", "missing key"),
        ({"tasks.split_fractions": {"train": 0.5, "holdout": 0.3}}, "tasks.split_fractions", "sum to 1"),
        (
            {"tasks.split_fractions": {"train": 1.5, "holdout": -0.5}},
            "tasks.split_fractions",
            "between 0 and 1",
        ),
        ({"tasks.split_fractions": {"train": 0.9, "dev": 0.1}}, "tasks.split_fractions.dev", "'canary'"),
        (
            {"tasks.split_column": "split", "tasks.split_fractions": {"train": 1.0}},
            "tasks",
            "split_column or split_fractions, not both",
        ),
        ({"reward": "hooks:VALUE"}, "reward", "not callable"),
        ({"model": {"path": "no-model"}}, "model.path", "does not exist"),
        ({"model": {"path": "tasks.jsonl"}}, "model.path", "is not a directory"),
        ({"model": {"path": "."}}, "model.path", "has no config.json"),
        (
            {"serving.upstream_url": "http://localhost:8000"},
            "model.tokenizer",
            "serving.upstream_url needs it",
        ),
        (
            {"serving.upstream_url": "http://localhost:8000", "model": {"path": "model"}},
            "serving.upstream_url",
            "at most one of model.path, serving.upstream_url",
        ),
        ({"model": {"warm_start": "demos.jsonl"}}, "model.warm_start", "does not exist"),
        ({"model": {"tokenizer": "."}}, "model.tokenizer", "has no tokenizer"),
        ({"model": {"path": "model", "tokenizer": "model"}}, "model", "a path has its own"),
    ],
)
def test_a_bad_project_file_names_the_file_and_key(tmp_path, changes, key, fragment):
    file = write_project(tmp_path, changes)
    script = tmp_path / NOT_EXECUTABLE
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    _model_folder(tmp_path / "model")
    with pytest.raises(ProjectError) as caught:
        load_project(file)
    assert caught.value.file == file
    assert key in caught.value.keys
    assert str(caught.value).startswith(f"{file}: ")
    assert f"{key}: " in str(caught.value)
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("name: [unclosed\n", "not valid YAML"),
        ("- a list\n", "expected a mapping"),
        ("", "expected a mapping"),
        # PyYAML keeps the last of two equal keys: the first would be dropped without a word
        ("name: a\nharness: {command: [python]}\ntasks: {path: t.jsonl}\nname: b\n", "duplicate key 'name'"),
        ("name: a\nharness: {env_map: {}, command: [python], env_map: {}}\n", "duplicate key 'env_map'"),
    ],
)
def test_a_file_that_is_not_a_mapping_is_a_project_error(tmp_path, text, fragment):
    file = tmp_path / PROJECT_FILE
    file.write_text(text)
    with pytest.raises(ProjectError, match=fragment) as caught:
        load_project(file)
    assert caught.value.file == file


def test_a_missing_project_file_is_a_project_error_that_suggests_init(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProjectError, match="lightning-dagster init") as caught:
        load_project()
    assert caught.value.file == tmp_path / PROJECT_FILE


def test_without_a_path_the_project_file_in_the_working_directory_loads(tmp_path, monkeypatch):
    write_project(tmp_path)
    monkeypatch.chdir(tmp_path)
    project = load_project()
    assert project.file == tmp_path / PROJECT_FILE
    assert project.root == tmp_path


def test_a_folder_stands_for_its_project_file(tmp_path):
    write_project(tmp_path)
    assert load_project(tmp_path).file == tmp_path / PROJECT_FILE


def _model_folder(path):
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')


def test_a_full_project_resolves_paths_relative_to_its_file(tmp_path, monkeypatch):
    _model_folder(tmp_path / "model")
    (tmp_path / "demos.jsonl").write_text("")
    (tmp_path / "roles.yaml").write_text("actors: {}\n")
    policy = resources.files("lightning_dagster.gate").joinpath("policies/default-v1.yaml").read_text()
    (tmp_path / "policy.yaml").write_text(policy)
    file = write_project(
        tmp_path,
        {
            "harness": {
                "python": "hooks:run",
                "expected_spans": ["llm", "reward", "effect"],
                "env_map": {"LD_QUESTION": "question"},
                "prepare": "hooks:run",
                "verify": "hooks:judge",
            },
            "tasks": {"path": "tasks.jsonl", "split_fractions": {"train": 0.7, "holdout": 0.3}},
            "reward": "hooks:judge",
            "model": {"path": "model", "warm_start": "demos.jsonl"},
            "training": {"attempt_timeout_s": 12.5, "max_attempts": 2, "steps": 3},
            "serving": {"runner_mode": "subprocess"},
            "gate": {"policy_path": "policy.yaml", "roles_path": "roles.yaml"},
        },
    )
    monkeypatch.chdir("/")  # relative paths follow the project file, not the working directory
    project = load_project(file)
    assert project.harness.kind == "python"
    assert (project.training.attempt_timeout_s, project.training.max_attempts) == (12.5, 2)
    # Each section holds its concern's settings, and knows which keys the file set.
    assert project.training.given() == {"attempt_timeout_s": 12.5, "max_attempts": 2, "steps": 3}
    assert project.serving.given() == {"runner_mode": "subprocess"} and project.serving.max_batch == 64
    assert project.harness.expected_spans == ("llm", "reward", "effect")
    assert project.harness.env_map == {"LD_QUESTION": "question"}
    assert project.tasks.path == tmp_path / "tasks.jsonl"
    assert project.tasks.split_column is None
    assert project.model.path == tmp_path / "model"
    assert project.model.warm_start == tmp_path / "demos.jsonl"
    assert project.gate.policy_path == str(tmp_path / "policy.yaml")
    assert project.gate.roles_path == str(tmp_path / "roles.yaml")


def test_defaults_are_a_split_column_and_the_llm_and_reward_spans(tmp_path):
    project = load_project(write_project(tmp_path))
    assert project.harness.kind == "command"
    assert (project.tasks.id_column, project.tasks.family_column, project.tasks.split_column) == (
        "task_id",
        "family",
        "split",
    )
    assert project.harness.expected_spans == ("llm", "reward")
    # No settings sections: each is its class's defaults, none of them set by the file.
    assert project.training == TrainingSettings() and not project.training.given()
    assert not project.serving.given() and not project.gate.given()
    # One default for how long an attempt runs and how often it is tried: the settings', also a spec's.
    spec = HarnessSpec(name="x", expected_span_families=(), argv=("true",))
    assert (spec.timeout_s, spec.max_attempts) == (
        project.training.attempt_timeout_s,
        project.training.max_attempts,
    )
    # One default for what a command's attempt keeps of each output stream, wherever it is declared.
    spec_default = HarnessSpec(name="x", expected_span_families=(), argv=("true",)).max_output_bytes
    assert project.harness.max_output_bytes == spec_default == DEFAULT_MAX_OUTPUT_BYTES == 4 * 1024 * 1024
    assert project.model is None and project.reward is None and project.gate.policy_path == ""


def test_a_command_program_resolves_on_path_relative_to_the_project_or_to_this_python(tmp_path):
    script = tmp_path / "bin" / "agent.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n")
    os.chmod(script, 0o755)
    assert load_project(write_project(tmp_path)).harness.command == (sys.executable, "agent.py")
    relative = load_project(write_project(tmp_path, {"harness.command": ["bin/agent.sh", "--fast"]}))
    assert relative.harness.command == (str(script), "--fast")
    on_path = load_project(write_project(tmp_path, {"harness.command": ["sh", "-c", "true"]}))
    assert os.path.isabs(on_path.harness.command[0]) and on_path.harness.command[0].endswith("/sh")


def test_each_project_imports_its_own_module_of_a_shared_name(tmp_path):
    # Two projects with a `hooks.py` each: the second must not get the first one's cached module.
    first = write_project(tmp_path / "one", {"reward": "hooks:judge"})
    second = write_project(tmp_path / "two", {"reward": "hooks:only_in_two"})
    load_project(first)
    (tmp_path / "two" / "hooks.py").write_text("def only_in_two(task, transcript):\n    return 0.0\n")
    assert load_project(second).reward == "hooks:only_in_two"
    assert sys.modules["hooks"].__file__ == str(tmp_path / "two" / "hooks.py")


def test_a_merge_key_may_be_overridden_without_counting_as_a_duplicate(tmp_path):
    file = write_project(tmp_path)
    file.write_text(
        "name: demo\n"
        "defaults: &defaults {command: [python, agent.py], max_output_bytes: 5000}\n"
        "harness: {<<: *defaults, max_output_bytes: 9000}\n"
        "tasks: {path: tasks.jsonl}\n"
    )
    with pytest.raises(ProjectError) as caught:  # only the anchor's own key is unknown
        load_project(file)
    assert caught.value.keys == ["defaults"]
