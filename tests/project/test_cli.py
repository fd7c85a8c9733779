"""`lightning-dagster init` writes a starter project that loads and whose agent works against an
OpenAI-compatible server; `project check` prints its counts; a bad project exits 2 without a traceback."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dagster.cli import main
from lightning_dagster.project import PROJECT_FILE, load_project, load_tasks
from lightning_dagster.project.splits import SPLITS
from tests.harnesses.scripted_llm import ScriptedLLM, say
from tests.project.helpers import task_rows, write_project

ROOT = Path(__file__).resolve().parents[2]


def test_init_writes_a_starter_project_that_loads_with_every_split(tmp_path, capsys):
    folder = tmp_path / "new" / "agent"
    assert main(["init", str(folder)]) == 0
    files = ["agent.py", "demos.jsonl", PROJECT_FILE, "tasks.jsonl"]
    assert sorted(p.name for p in folder.iterdir()) == files
    project = load_project(folder)
    assert project.harness.command == (sys.executable, "agent.py")
    assert project.model is not None and project.model.warm_start == folder / "demos.jsonl"
    tasks = load_tasks(project)
    assert len(tasks) == 1000  # distinct two-digit word problems
    assert {split: len(tasks.splits[split]) for split in SPLITS} == {
        "train": 700,
        "holdout": 200,
        "protected": 50,
        "canary": 50,
    }
    assert all(set(tasks.families(split)) == {"add", "subtract"} for split in SPLITS)
    assert len({t["question"] for split in SPLITS for t in tasks.splits[split]}) == 1000
    assert f"project check --project {folder}" in capsys.readouterr().out


def test_the_starters_demonstrations_are_its_train_tasks_answered_as_its_agent_asks(tmp_path):
    main(["init", str(tmp_path)])
    project = load_project(tmp_path)
    train = load_tasks(project).splits["train"]
    demos = [json.loads(line) for line in (tmp_path / "demos.jsonl").read_text().splitlines()]
    agent = (tmp_path / "agent.py").read_text()
    assert len(demos) == len(train)
    for task, demo in zip(train, demos, strict=True):
        system, user, reply = demo["messages"]
        assert f'"content": "{system["content"]}"' in agent  # the agent's own system prompt
        assert user == {"role": "user", "content": task["question"]}
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)", reply["content"]).groups()
        assert a in task["question"] and b in task["question"]
        assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == task["answer"]
    held_out = {
        t["question"] for s in ("holdout", "protected", "canary") for t in load_tasks(project).splits[s]
    }
    assert not held_out & {d["messages"][1]["content"] for d in demos}


def test_init_writes_the_same_tasks_every_time(tmp_path):
    main(["init", str(tmp_path / "a")])
    main(["init", str(tmp_path / "b")])
    assert (tmp_path / "a" / "tasks.jsonl").read_text() == (tmp_path / "b" / "tasks.jsonl").read_text()


def test_init_refuses_a_folder_that_is_not_empty(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["init", str(tmp_path)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize(
    ("reply", "reward"), [("12+7", 1.0), (" 12 + 7 ", 1.0), ("12-7", 0.0), ("19", 0.0), ("12+7 is 19", 0.0)]
)
def test_the_starter_agent_asks_the_model_and_posts_its_reward(tmp_path, reply, reward):
    main(["init", str(tmp_path)])
    question = "Bo has 12 pens and gets 7 more. How many now?"
    task = {"task_id": "t1", "family": "add", "split": "train", "question": question, "answer": 19}
    with ScriptedLLM([say(reply)]) as llm:
        env = {
            **os.environ,
            "LD_TASK": json.dumps(task),
            "OPENAI_BASE_URL": f"{llm.url}/v1",
            "OPENAI_API_KEY": "k-1",
            "AGL_EVENT_URL": f"{llm.url}/v1/events",
            "AGL_KEY": "k-1",
        }
        done = subprocess.run(
            [sys.executable, "agent.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 0, done.stderr
    assert llm.requests[0]["messages"][-1] == {"role": "user", "content": task["question"]}
    assert llm.events == [("Bearer k-1", {"event_type": "reward", "data": {"value": reward}})]
    assert json.loads(done.stdout) == {"task_id": "t1", "reward": reward}


def test_project_check_prints_rows_per_split_and_family(tmp_path, capsys):
    main(["init", str(tmp_path)])
    capsys.readouterr()
    assert main(["project", "check", "--project", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"project my-agent ({tmp_path / PROJECT_FILE})"
    assert f"harness: command {sys.executable} agent.py" in out
    table = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert table["split"] == ["rows", "add", "subtract"]
    assert table["train"] == ["700", "362", "338"]
    assert table["holdout"] == ["200", "86", "114"]
    assert table["protected"] == ["50", "25", "25"]
    assert table["canary"] == ["50", "20", "30"]
    assert out.splitlines()[-1] == "ok"


def test_project_check_fails_when_a_split_is_empty(tmp_path, capsys):
    rows = [{"task_id": f"t{i}", "family": "f", "split": "train"} for i in range(3)]
    write_project(tmp_path, rows=rows)
    assert main(["project", "check", "--project", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert "  train" in captured.out
    assert "tasks.split_column: no tasks in split holdout, protected, canary" in captured.err


def test_a_bad_project_exits_2_with_the_message_and_no_traceback(tmp_path):
    file = write_project(tmp_path, {"harness.command": ["no-such-program-7f3a"]})
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dagster.cli", "project", "check", "--project", str(file)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {file}: harness.command: program 'no-such-program-7f3a' not found")
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_project_check_without_a_project_file_exits_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["project", "check"]) == 2
    assert f"error: {tmp_path / PROJECT_FILE}: cannot read the project file" in capsys.readouterr().err


def _python_m(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_dagster", *argv],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_python_m_lightning_dagster_runs_the_cli_with_its_exit_status(tmp_path):
    file = write_project(tmp_path / "ok", rows=task_rows())
    done = _python_m("project", "check", "--project", str(file), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"project demo ({file})"
    assert done.stdout.splitlines()[-1] == "ok"

    bad = write_project(tmp_path / "bad", {"harness.command": ["no-such-program-7f3a"]})
    done = _python_m("project", "check", "--project", str(bad), cwd=tmp_path)
    assert done.returncode == 2 and "harness.command: program 'no-such-program-7f3a' not found" in done.stderr

    done = _python_m("--help", cwd=tmp_path)
    assert done.returncode == 0 and "usage: lightning-dagster" in done.stdout and "rollouts" in done.stdout


@pytest.mark.parametrize(
    ("command", "missing"),
    [
        (["node", "agnet.mjs"], ["agnet.mjs"]),
        (["python", "src/agent.py", "--model", "gpt-4o"], ["src/agent.py"]),
        (
            ["python", "agent.py", "tools/run.sh", "https://example.com/x", "-c", "print('a/b')"],
            ["tools/run.sh"],
        ),
    ],
)
def test_project_check_fails_when_a_script_the_command_runs_is_missing(tmp_path, capsys, command, missing):
    if command[0] == "node":
        command[0] = sys.executable  # any program on this machine: only the script's absence is judged
    file = write_project(tmp_path, {"harness.command": command}, rows=task_rows())
    assert main(["project", "check", "--project", str(file)]) == 2
    err = capsys.readouterr().err
    for name in missing:
        assert f"harness.command: script {name!r} not found ({tmp_path / name} does not exist)" in err
    assert err.count("script ") == len(missing)
    (tmp_path / missing[0]).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / missing[0]).write_text("")
    assert main(["project", "check", "--project", str(file)]) == 0  # present: ok


def test_project_check_into_a_closed_pipe_exits_quietly(tmp_path):
    file = write_project(tmp_path, rows=task_rows())
    read, write = os.pipe()
    os.close(read)  # the reader (`| head`) is gone before anything is written
    try:
        done = subprocess.run(
            [sys.executable, "-m", "lightning_dagster", "project", "check", "--project", str(file)],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=write, stderr=subprocess.PIPE,
            text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write)
    assert done.returncode == 1 and done.stderr == ""
