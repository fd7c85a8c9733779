"""`harness_spec(project)`: each harness kind becomes the spec the runner runs, with the project's settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_dagster.project import ProjectError, load_project
from lightning_dagster.project.agl_launcher import AGL_LAUNCHER_USAGE, BadReward, read_task, reward_value
from lightning_dagster.project.harness import AGL_LAUNCHER, harness_spec, inprocess_entry
from tests.project.helpers import write_project


def test_a_command_harness_runs_its_program_in_the_project_folder_with_the_projects_settings(tmp_path):
    changes = {
        "training.attempt_timeout_s": 7.5,
        "training.max_attempts": 2,
        "harness.expected_spans": ["llm", "reward", "effect"],
        "harness.env_map": {"QUESTION": "question"},
        "harness.prepare": "hooks:run",
        "harness.max_output_bytes": 65536,
        "reward": "hooks:judge",
    }
    project = load_project(write_project(tmp_path, changes))
    spec = harness_spec(project)
    assert spec.max_output_bytes == 65536
    assert spec.name == "demo" and spec.command() == [sys.executable, "agent.py"]
    assert spec.cwd == tmp_path and spec.run_task is None
    assert spec.run_mode("inprocess") == "subprocess"  # a program cannot run in our process
    assert spec.expected_span_families == ("llm", "reward", "effect")
    policy = spec.retry_policy()
    assert (policy.timeout_s, policy.max_attempts) == (7.5, 2)
    assert spec.retry_policy(max_attempts=5).max_attempts == 5
    assert spec.prepare is sys.modules["hooks"].run and spec.verify is None
    assert spec.judge is sys.modules["hooks"].judge and spec.judge_name == "hooks:judge"


def test_an_agl_harness_runs_the_launcher_with_the_project_folder_and_class(tmp_path):
    project = load_project(write_project(tmp_path, {"harness.command": None, "harness.agl": "hooks:Agent"}))
    spec = harness_spec(project)
    assert spec.command() == [sys.executable, "-m", AGL_LAUNCHER, str(tmp_path), "hooks:Agent"]
    assert spec.run_mode("inprocess") == "subprocess" and spec.judge is None


def test_a_python_harness_runs_in_process_only(tmp_path):
    project = load_project(write_project(tmp_path, {"harness.command": None, "harness.python": "hooks:run"}))
    spec = harness_spec(project)
    assert spec.command() is None and spec.run_task is not None
    assert spec.run_mode("subprocess") == "inprocess"


def test_env_map_copies_strings_as_they_are_and_json_encodes_everything_else(tmp_path):
    env_map = {"Q": "question", "A": "answer", "META": "meta", "NOTE": "note"}
    project = load_project(write_project(tmp_path, {"harness.env_map": env_map}))
    task = {"question": "What is 2 + 2?", "answer": 4, "meta": {"level": [1, 2]}, "note": None}
    assert harness_spec(project).task_env(task) == {
        "Q": "What is 2 + 2?",
        "A": "4",
        "META": '{"level": [1, 2]}',
        "NOTE": "null",
    }


def test_a_reference_that_stopped_resolving_is_a_project_error_naming_its_key(tmp_path):
    project = load_project(write_project(tmp_path, {"reward": "hooks:judge"}))
    (tmp_path / "hooks.py").write_text("VALUE = 3\n")
    sys.modules.pop("hooks")
    with pytest.raises(ProjectError, match="reward: module 'hooks' has no attribute 'judge'"):
        harness_spec(project)


@pytest.mark.parametrize("value", [True, "1.0", float("nan"), [1.0]])
def test_a_reward_must_be_a_finite_number_or_none(value):
    assert reward_value(None, "f") is None and reward_value(1, "f") == 1.0
    with pytest.raises(BadReward, match="f returned"):
        reward_value(value, "f")


@pytest.mark.parametrize("value", [10**400, -(10**400), 2**1024])
def test_an_integer_too_large_for_a_float_is_a_bad_reward_not_an_overflow_error(value):
    with pytest.raises(BadReward, match="f returned an int too large for a float"):
        reward_value(value, "f")
    assert reward_value(2**1023, "f") == float(2**1023)  # the largest power of two a float holds


def test_an_inprocess_harness_returning_a_huge_integer_fails_with_bad_reward_before_posting(tmp_path):
    def solve(task, client):
        return 10**400

    run_task = inprocess_entry(solve, "agent:solve", 5.0)
    # Nothing listens on port 9: a reward that got as far as posting would raise a connection error.
    with pytest.raises(BadReward, match="agent:solve returned an int too large for a float"):
        run_task({}, base_url="http://127.0.0.1:9/v1", api_key="k", event_url="http://127.0.0.1:9/v1/events")


def test_read_task_takes_the_environment_variable_else_the_file_ld_task_file_names(tmp_path):
    (tmp_path / "task.json").write_text(json.dumps({"task_id": "big", "text": "é"}), encoding="utf-8")
    assert read_task({"LD_TASK_FILE": str(tmp_path / "task.json")}) == {"task_id": "big", "text": "é"}
    both = {"AGL_TASK": '{"task_id": "env"}', "LD_TASK_FILE": str(tmp_path / "task.json")}
    assert read_task(both) == {"task_id": "env"}
    assert read_task({"LD_TASK": '{"task_id": "ld"}'}) == {"task_id": "ld"}
    with pytest.raises(KeyError, match="none of AGL_TASK, LD_TASK and LD_TASK_FILE"):
        read_task({})


def test_the_launcher_refuses_a_class_it_cannot_load_with_exit_status_and_message(tmp_path):
    write_project(tmp_path)
    run = [sys.executable, "-m", AGL_LAUNCHER]
    missing = subprocess.run([*run, str(tmp_path), "hooks:Nope"], capture_output=True, text=True)
    assert missing.returncode == 1 and "has no attribute 'Nope'" in missing.stderr
    assert "Traceback" not in missing.stderr
    usage = subprocess.run(run, capture_output=True, text=True)
    assert usage.returncode == 2 and AGL_LAUNCHER_USAGE in usage.stderr


def test_the_launcher_posts_what_run_returns_and_nothing_when_it_returns_none(tmp_path):
    (tmp_path / "agents.py").write_text(
        "class Posts:\n    def run(self):\n        return 0.5\n"
        "class Silent:\n    def run(self):\n        print('ran')\n"
    )
    code = (
        "import json, sys\n"
        "import lightning_dagster.project.agl_launcher as agl\n"
        "agl.post_reward = lambda url, key, value: print(json.dumps([url, key, value]))\n"
        "sys.exit(agl.main(sys.argv[1:]))\n"
    )
    env = {"AGL_EVENT_URL": "http://gw/v1/events", "AGL_KEY": "k", "PATH": ""}
    env["PYTHONPATH"] = ":".join(sys.path)
    posts = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), "agents:Posts"], capture_output=True, text=True, env=env
    )
    assert posts.returncode == 0, posts.stderr
    assert json.loads(posts.stdout) == ["http://gw/v1/events", "k", 0.5]
    silent = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path), "agents:Silent"], capture_output=True, text=True, env=env
    )
    assert silent.returncode == 0 and silent.stdout == "ran\n"
