"""Project harnesses of every kind run through the runner against the real gateway, engine and store: the
starter project from `init` through the CLI, a Node.js program, an Agent Lightning class unchanged, an
in-process function, a judge, and what a command harness receives (LD_TASK, stdin, env_map, cwd)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from lightning_dagster.cli import main
from lightning_dagster.project import load_project, load_tasks
from lightning_dagster.project.harness import harness_spec
from lightning_dagster.project.scaffold import write_starter
from lightning_dagster.runner import RetryPolicy, Runner, enqueue_tasks
from lightning_dagster.types import AttemptState, SpanKind
from tests.project.helpers import task_rows, write_jsonl
from tests.support.project_imports import restore_import_state  # noqa: F401 (autouse)
from tests.support.secrets import gateway_args

REPO = Path(__file__).resolve().parents[2]
NODE_EXAMPLE = REPO / "examples" / "node-agent"
# One chat call through the attempt's gateway with the standard library.
CHAT = """
import json, os, urllib.request

def chat(question, base=None, key=None):
    body = {"model": "policy", "messages": [{"role": "user", "content": question}], "max_tokens": 4}
    req = urllib.request.Request((base or os.environ["OPENAI_BASE_URL"]) + "/chat/completions",
        method="POST", data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + (key or os.environ["OPENAI_API_KEY"]),
                 "Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req).read())
"""


def make_project(
    folder: Path, harness: dict[str, Any], files: dict[str, str], *, reward: str | None = None, rows=None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    write_jsonl(folder / "tasks.jsonl", task_rows() if rows is None else rows)
    data: dict[str, Any] = {"name": folder.name, "harness": harness, "tasks": {"path": "tasks.jsonl"}}
    if reward is not None:
        data["reward"] = reward
    (folder / "lightning-dagster.yaml").write_text(yaml.safe_dump(data))
    return folder


def run_project(store, gateway, folder: Path, tmp_path: Path, *, n: int = 1, split: str = "train"):
    """Run the first `n` tasks of `split` of the project in `folder`; returns (spec, summary, rollouts)."""
    project = load_project(folder)
    spec = harness_spec(project)
    tasks = load_tasks(project).splits[split][:n]
    rollouts = enqueue_tasks(store, spec, tasks, kind=split)
    runner = Runner(
        store,
        gateway.url,
        secret=gateway.secret,
        harness=spec,
        parallel=2,
        policy=RetryPolicy(max_attempts=1, timeout_s=60.0),
        workdir=tmp_path / "attempts",
        decode=gateway.codec.decode,
    )
    summary = runner.run([r.rollout_id for r in rollouts])
    return runner, summary, rollouts


def only_attempt(store, rollout_id: str):
    (attempt,) = store.list_attempts(rollout_id=rollout_id)
    return attempt


def reward_of(store, attempt_id: str):
    (reward,) = [r for r in store.list_rewards() if r.attempt_id == attempt_id]
    return reward


def test_the_starter_project_runs_through_the_cli_and_records_a_reward_per_rollout(
    store, gateway, tmp_path, capsys
):
    write_starter(tmp_path / "starter")
    argv = ["rollouts", "run", "--project", str(tmp_path / "starter"), "--split", "holdout", "--n", "2", "--group-size", "1"]
    argv += [*gateway_args(gateway, store, tmp_path), "--json"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["harness"] == "my-agent" and summary["rollouts_by_status"] == {"succeeded": 2}
    assert summary["rewards"] == 2 and summary["span_coverage"] == 1.0
    holdout = load_tasks(load_project(tmp_path / "starter")).splits["holdout"]
    rollouts = [store.get_rollout(rid) for rid in summary["rollout_ids"]]
    assert [r.task for r in rollouts] == holdout[:2]  # the first n of the split, as the project reads it
    rewards = store.list_rewards(rollout_ids=summary["rollout_ids"])
    assert len(rewards) == 2 and {r.judge for r in rewards} == {"harness"}


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_node_example_records_exact_token_ids_and_its_reward(store, gateway, tmp_path):
    runner, summary, rollouts = run_project(store, gateway, NODE_EXAMPLE, tmp_path, n=2)
    assert runner.mode == "subprocess" and summary.rollouts_by_status == {"succeeded": 2}
    codec = gateway.codec
    for rollout in rollouts:
        attempt = only_attempt(store, rollout.rollout_id)
        printed = json.loads(
            (tmp_path / "attempts" / rollout.rollout_id / attempt.attempt_id / "stdout").read_text()
        )
        assert printed["messages"][1]["content"] == rollout.task["question"]
        (llm,) = store.list_spans(attempt_id=attempt.attempt_id, kind=SpanKind.llm)
        # The prompt the gateway recorded is exactly the chat the program sent, rendered by the checkpoint.
        assert llm.prompt_token_ids == codec.render(printed["messages"])
        assert llm.response_token_ids and len(llm.response_logprobs) == len(llm.response_token_ids)
        content, _ = codec.parse_assistant(codec.decode(llm.response_token_ids))
        assert (content or "") == printed["reply"]
        reward = reward_of(store, attempt.attempt_id)
        assert (reward.value, reward.judge) == (printed["reward"], "harness")


AGL_AGENTS = (
    CHAT
    + """
import asyncio


class SyncAgent:
    def run(self):
        task = json.loads(os.environ["AGL_TASK"])
        chat(task["question"], os.environ["AGL_OPENAI_BASE_URL"], os.environ["AGL_KEY"])
        print(json.dumps({"rollout": os.environ["AGL_ROLLOUT_ID"], "cwd": os.getcwd()}))
        return 0.25


class AsyncAgent:
    async def run(self):
        task = json.loads(os.environ["AGL_TASK"])
        await asyncio.to_thread(chat, task["question"], os.environ["AGL_OPENAI_BASE_URL"], os.environ["AGL_KEY"])
        print(json.dumps({"rollout": os.environ["AGL_ROLLOUT_ID"], "cwd": os.getcwd()}))
        return 0.75
"""
)


@pytest.mark.parametrize(("agent", "value"), [("SyncAgent", 0.25), ("AsyncAgent", 0.75)])
def test_an_agent_lightning_class_runs_unchanged_and_what_run_returns_is_its_reward(
    store, gateway, tmp_path, agent, value
):
    folder = make_project(
        tmp_path / f"agl-{agent}", {"agl": f"agl_agents:{agent}"}, {"agl_agents.py": AGL_AGENTS}
    )
    runner, summary, (rollout,) = run_project(store, gateway, folder, tmp_path)
    assert runner.mode == "subprocess" and summary.rollouts_by_status == {"succeeded": 1}
    attempt = only_attempt(store, rollout.rollout_id)
    printed = json.loads(
        (tmp_path / "attempts" / rollout.rollout_id / attempt.attempt_id / "stdout").read_text()
    )
    assert printed == {"rollout": rollout.rollout_id, "cwd": str(folder)}
    assert len(store.list_spans(attempt_id=attempt.attempt_id, kind=SpanKind.llm)) == 1
    reward = reward_of(store, attempt.attempt_id)
    assert (reward.value, reward.judge) == (value, "harness")


PYTHON_HARNESS = """
import os

CALLS = []


def solve(task, client):
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["question"]}], max_tokens=4
    )
    CALLS.append((os.getpid(), task["task_id"], reply.id))
    return 0.625
"""


def test_a_python_harness_runs_in_process_and_the_number_it_returns_is_its_reward(store, gateway, tmp_path):
    folder = make_project(tmp_path / "py", {"python": "py_harness:solve"}, {"py_harness.py": PYTHON_HARNESS})
    runner, summary, rollouts = run_project(store, gateway, folder, tmp_path, n=2)
    assert runner.mode == "inprocess" and summary.rollouts_by_status == {"succeeded": 2}
    calls = sys.modules["py_harness"].CALLS
    assert sorted(task_id for _, task_id, _ in calls) == sorted(r.task_id for r in rollouts)
    assert {pid for pid, _, _ in calls} == {__import__("os").getpid()}
    for rollout in rollouts:
        attempt = only_attempt(store, rollout.rollout_id)
        assert len(store.list_spans(attempt_id=attempt.attempt_id, kind=SpanKind.llm)) == 1
        assert reward_of(store, attempt.attempt_id).value == 0.625


PROBE = """
import json, os, sys
print(json.dumps({
    "ld_task": os.environ["LD_TASK"],
    "stdin": sys.stdin.read(),
    "cwd": os.getcwd(),
    "mapped": {name: os.environ.get(name) for name in ("QUESTION", "ANSWER", "META", "OPENAI_API_KEY")},
    "inherited": {name: os.environ.get(name) for name in ("TOOL_API_KEY", "UNLISTED_VAR")},
}))
"""


# An agent as it runs in production: the `openai` client, configured by OPENAI_BASE_URL / OPENAI_API_KEY,
# asking for its own model name (argv[1]), then posting its reward.
NAMED = """
import json, os, sys, urllib.request
import openai

openai.OpenAI(max_retries=0).chat.completions.create(
    model=sys.argv[1], messages=[{"role": "user", "content": "hi"}], max_tokens=4)
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""


def test_an_unmodified_agent_runs_under_its_own_model_name_and_model_names_restricts_with_a_404(
    store, model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    harness = {"command": ["python", "named.py", "default"]}
    folder = make_project(tmp_path / "named", harness, {"named.py": NAMED})
    assert harness_spec(load_project(folder)).model_names == ()
    argv = ["rollouts", "run", "--project", str(folder), "--model", str(model_dir), "--store-url", store.url]
    assert main([*argv, "--group-size", "1", "--n", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["rollouts_by_status"] == {"succeeded": 1} and summary["rewards"] == 1
    assert summary["failures"] == {}
    (span,) = store.list_spans(rollout_ids=summary["rollout_ids"], kind="llm")
    assert span.attributes["requested_model"] == "default"  # the name the agent sent, on the record

    # Restricted to other names, the agent's is a 404 naming the setting: every rollout fails, the run exits 1,
    # and each failure reason is said with its count, the example message and the attempt's folder.
    make_project(tmp_path / "named", {**harness, "model_names": ["gpt-4o-mini"]}, {"named.py": NAMED})
    assert main([*argv, "--group-size", "2", "--n", "1", "--json"]) == 1
    out, err = capsys.readouterr()
    summary = json.loads(out)  # stdout: the JSON alone
    assert summary["rollouts_by_status"] == {"failed": 2} and summary["rewards"] == 0
    failure = summary["failures"]["exit_nonzero"]
    assert failure["rollouts"] == 2 and failure["example"].startswith("openai.NotFoundError: Error code: 404")
    assert "model_names" in failure["example"] and "allows only" in failure["example"]
    folder = Path(failure["dir"])
    assert folder.parent.parent == tmp_path / "home" / "attempts" and (folder / "stderr").is_file()
    assert failure["example"] == (folder / "stderr").read_text().strip().splitlines()[-1]
    said = f"failed: exit_nonzero in 2 rollout(s), e.g. {failure['example']!r} (files: {folder})"
    assert said in err.splitlines()
    assert err.splitlines()[-1] == "error: no rollout succeeded (0 of 2)"


ASK_AND_REWARD = (
    CHAT
    + """
chat("hi")
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": 1.0}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""
)


def _with_model(folder: Path, model: dict[str, Any], **sections: dict[str, Any]) -> Path:
    file = folder / "lightning-dagster.yaml"
    file.write_text(yaml.safe_dump({**yaml.safe_load(file.read_text()), "model": model, **sections}))
    return folder


def test_rollouts_run_serves_the_projects_model_path_not_the_embedded_default(
    store, model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    # a copy of the tiny locally built model, so its path is the project's own and no other test's
    own = shutil.copytree(model_dir, tmp_path / "my-model")
    folder = make_project(
        tmp_path / "with-model", {"command": ["python", "ask.py"]}, {"ask.py": ASK_AND_REWARD}
    )
    _with_model(folder, {"path": str(own)})
    argv = ["rollouts", "run", "--project", str(folder), "--n", "2", "--group-size", "1", "--store-url", store.url, "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["rollouts_by_status"] == {"succeeded": 2} and summary["rewards"] == 2
    assert f"model: {own} (the project's model.path)" in err
    for rollout_id in summary["rollout_ids"]:
        rollout = store.get_rollout(rollout_id)
        assert store.get_resource(rollout.resource_id).uri == str(own.resolve())
        (llm,) = store.list_spans(rollout_id=rollout_id, kind=SpanKind.llm)
        assert llm.resource_id == rollout.resource_id
    # the embedded default was neither built nor served
    assert not (tmp_path / "home" / "models" / "base").exists()


def test_rollouts_run_forwards_to_the_projects_upstream_with_its_tokenizer(
    store, model_dir, tmp_path, monkeypatch, capsys
):
    from lightning_dagster.gateway.server import GatewayServer
    from tests.support.stub_upstream import create_stub_app

    monkeypatch.setenv("LIGHTNING_DAGSTER_HOME", str(tmp_path / "home"))
    folder = make_project(
        tmp_path / "with-upstream", {"command": ["python", "ask.py"]}, {"ask.py": ASK_AND_REWARD}
    )
    with GatewayServer(create_stub_app()) as stub:
        _with_model(folder, {"tokenizer": str(model_dir)}, serving={"upstream_url": stub.url})
        argv = ["rollouts", "run", "--project", str(folder), "--n", "2", "--group-size", "1", "--store-url", store.url, "--json"]
        assert main(argv) == 0
        calls = dict(stub.app.state.calls)
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["rollouts_by_status"] == {"succeeded": 2}
    assert f"model: {stub.url} (the project's serving.upstream_url)" in err
    # with the tokenizer, every call went to the upstream as exact token ids
    assert calls == {"completions": 2}
    for rollout_id in summary["rollout_ids"]:
        (llm,) = store.list_spans(rollout_id=rollout_id, kind=SpanKind.llm)
        assert llm.attributes["backend"] == "upstream" and llm.prompt_token_ids
    assert not (tmp_path / "home" / "models" / "base").exists()


def test_a_command_harness_gets_its_task_in_ld_task_and_on_stdin_and_env_map_in_variables(
    store, gateway, tmp_path, monkeypatch
):
    rows = [{**row, "meta": {"level": i}} for i, row in enumerate(task_rows())]
    env_map = {"QUESTION": "question", "ANSWER": "answer", "META": "meta", "OPENAI_API_KEY": "question"}
    folder = make_project(
        tmp_path / "probe",
        {"command": ["python", "probe.py"], "env_map": env_map, "env_passthrough": ["TOOL_API_KEY"]},
        {"probe.py": PROBE},
        rows=rows,
    )
    monkeypatch.setenv("TOOL_API_KEY", "tool-secret")
    monkeypatch.setenv("UNLISTED_VAR", "not for harnesses")
    _, summary, (rollout,) = run_project(store, gateway, folder, tmp_path)
    attempt = only_attempt(store, rollout.rollout_id)
    printed = json.loads(
        (tmp_path / "attempts" / rollout.rollout_id / attempt.attempt_id / "stdout").read_text()
    )
    assert json.loads(printed["ld_task"]) == rollout.task and printed["stdin"] == printed["ld_task"]
    assert printed["cwd"] == str(folder)
    task = rollout.task
    assert printed["mapped"]["QUESTION"] == task["question"]
    assert printed["mapped"]["ANSWER"] == json.dumps(task["answer"])
    assert json.loads(printed["mapped"]["META"]) == task["meta"]
    # A mapped name never replaces the attempt's own key.
    assert printed["mapped"]["OPENAI_API_KEY"] != task["question"]
    # Of our environment, only the allowlist and the names the project passes through reach the harness.
    assert printed["inherited"] == {"TOOL_API_KEY": "tool-secret", "UNLISTED_VAR": None}
    assert attempt.reason_code == "no_reward" and summary.missing_rewards == 1


HUGE_PROBE = """
import json, os, sys
from lightning_dagster.project.agl_launcher import read_task
with open(os.environ["LD_TASK_FILE"], encoding="utf-8") as fh:
    from_file = fh.read()
task = read_task()
print(json.dumps({
    "has": sorted(name for name in ("LD_TASK", "AGL_TASK", "LD_TASK_FILE") if name in os.environ),
    "file": from_file,
    "stdin": sys.stdin.read(),
    "read_task_ok": task == json.loads(from_file),
}))
req = urllib.request.Request(os.environ["AGL_EVENT_URL"], method="POST",
    data=json.dumps({"event_type": "reward", "data": {"value": len(task["blob"]) / 1024}}).encode(),
    headers={"Authorization": "Bearer " + os.environ["AGL_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""


def test_a_200_kib_task_reaches_a_subprocess_harness_through_ld_task_file_and_stdin(store, gateway, tmp_path):
    # Linux refuses to exec with one environment string over 128 KiB (E2BIG): the task is left out of LD_TASK
    # and AGL_TASK and passed in LD_TASK_FILE (and on standard input); a small task keeps LD_TASK as well.
    rows = task_rows()
    rows[0]["blob"] = "x" * (200 * 1024)
    rows[1]["blob"] = "small"
    folder = make_project(
        tmp_path / "huge", {"command": ["python", "probe.py"]}, {"probe.py": CHAT + HUGE_PROBE}, rows=rows
    )
    _, summary, rollouts = run_project(store, gateway, folder, tmp_path, n=2)
    assert summary.rollouts_by_status == {"succeeded": 2}
    huge, small = sorted(rollouts, key=lambda r: len(r.task["blob"]), reverse=True)
    for rollout, expected in ((huge, ["LD_TASK_FILE"]), (small, ["AGL_TASK", "LD_TASK", "LD_TASK_FILE"])):
        attempt = only_attempt(store, rollout.rollout_id)
        assert (attempt.state, attempt.reason_code) == (AttemptState.succeeded, "ok")
        printed = json.loads(
            (tmp_path / "attempts" / rollout.rollout_id / attempt.attempt_id / "stdout").read_text()
        )
        assert printed["has"] == expected
        assert json.loads(printed["file"]) == rollout.task and printed["stdin"] == printed["file"]
        assert printed["read_task_ok"] is True
        assert reward_of(store, attempt.attempt_id).value == len(rollout.task["blob"]) / 1024
    assert len(json.dumps(huge.task).encode()) > 128 * 1024
    # the attempt says why its task was not in LD_TASK; the small one's reason says nothing of it
    assert "AGL_TASK and LD_TASK were left out" in only_attempt(store, huge.rollout_id).reason_message
    assert "LD_TASK" not in (only_attempt(store, small.rollout_id).reason_message or "")


JUDGE = """
SEEN = []


def score(task, transcript):
    SEEN.append((task, transcript))
    return 0.5 + len(transcript)
"""
SILENT = CHAT + "\nchat('hello')\nchat('again')\n"


def test_a_judge_scores_an_attempt_that_posted_no_reward_from_its_transcript(store, gateway, tmp_path):
    folder = make_project(
        tmp_path / "judged",
        {"command": ["python", "silent.py"]},
        {"silent.py": SILENT, "judges.py": JUDGE},
        reward="judges:score",
    )
    _, summary, (rollout,) = run_project(store, gateway, folder, tmp_path)
    attempt = only_attempt(store, rollout.rollout_id)
    assert (attempt.state, attempt.reason_code) == (AttemptState.succeeded, "ok")
    reward = reward_of(store, attempt.attempt_id)
    assert (reward.value, reward.judge) == (2.5, "judges:score")
    ((task, transcript),) = sys.modules["judges"].SEEN
    assert task == rollout.task
    llm = store.list_spans(attempt_id=attempt.attempt_id, kind=SpanKind.llm)
    assert transcript == [
        {
            "name": "chat.completions",
            "prompt_token_ids": span.prompt_token_ids,
            "response_token_ids": span.response_token_ids,
            "finish_reason": span.finish_reason,
            "response_text": gateway.codec.decode(span.response_token_ids),
        }
        for span in llm
    ]
    assert len(transcript) == 2 and summary.rewards == 1 and summary.span_coverage == 1.0


def test_a_judge_that_breaks_fails_the_attempt_with_its_message(store, gateway, tmp_path):
    folder = make_project(
        tmp_path / "badjudge",
        {"command": ["python", "silent.py"]},
        {"silent.py": SILENT, "bad_judges.py": "def score(task, transcript):\n    return 'great'\n"},
        reward="bad_judges:score",
    )
    _, summary, (rollout,) = run_project(store, gateway, folder, tmp_path)
    attempt = only_attempt(store, rollout.rollout_id)
    assert (attempt.state, attempt.reason_code) == (AttemptState.failed, "judge_error")
    assert "judge bad_judges:score returned str 'great'" in attempt.reason_message
    assert store.list_rewards(rollout_id=rollout.rollout_id) == []


@pytest.mark.parametrize(
    ("harness", "message"),
    [
        ({"command": ["no-such-program-here"]}, "harness.command: program 'no-such-program-here' not found"),
        ({"agl": "nowhere:Agent"}, "harness.agl: no module 'nowhere'"),
        (
            {"command": ["python", "a.py"], "env_passthrough": ["LD_STORE_URL"]},
            "harness.env_passthrough: LD_STORE_URL: LD_* and MLFLOW_* variables",
        ),
        (
            {"command": ["python", "a.py"], "model_names": [""]},
            "harness.model_names: '' is not a model name",
        ),
    ],
)
def test_a_bad_project_exits_2_with_its_message_and_no_traceback(tmp_path, capsys, harness, message):
    folder = make_project(tmp_path / "bad", harness, {})
    assert main(["rollouts", "run", "--project", str(folder), "--n", "1", "--group-size", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: ") and "Traceback" not in err


def test_a_missing_project_file_or_an_empty_split_exits_2(tmp_path, capsys):
    assert main(["rollouts", "run", "--project", str(tmp_path), "--n", "1", "--group-size", "1"]) == 2
    assert "cannot read the project file" in capsys.readouterr().err
    rows = [row for row in task_rows() if row["split"] != "canary"]
    folder = make_project(tmp_path / "nocanary", {"command": ["python", "x.py"]}, {"x.py": ""}, rows=rows)
    assert main(["rollouts", "run", "--project", str(folder), "--split", "canary", "--n", "1", "--group-size", "1"]) == 2
    assert "no tasks in split canary" in capsys.readouterr().err


def test_without_harness_or_project_the_cli_reads_the_working_directorys_project(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert main(["rollouts", "run", "--n", "1", "--group-size", "1"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "lightning-dagster.yaml") in err and "lightning-dagster init DIR" in err


POST_TO_REWARDS = """
import json, os, urllib.request
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/rewards", method="POST",
    data=json.dumps({"value": 0.3, "judge": "self-check"}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
urllib.request.urlopen(req).read()
"""


def test_a_reward_posted_to_the_openai_base_url_is_the_attempts_and_no_judge_runs(store, gateway, tmp_path):
    folder = make_project(
        tmp_path / "rewards-route",
        {"command": ["python", "post.py"]},
        {"post.py": POST_TO_REWARDS, "judges.py": JUDGE},
        reward="judges:score",
    )
    _, summary, (rollout,) = run_project(store, gateway, folder, tmp_path)
    attempt = only_attempt(store, rollout.rollout_id)
    assert (attempt.state, attempt.reason_code) == (AttemptState.succeeded, "ok")
    reward = reward_of(store, attempt.attempt_id)
    assert (reward.value, reward.judge) == (0.3, "self-check")
    assert sys.modules["judges"].SEEN == []


def test_an_inprocess_harness_that_prints_leaves_the_json_summary_parseable(store, gateway, tmp_path, capsys):
    """A `python` harness runs in the CLI's own process: its prints go to stderr, stdout is the summary."""
    noisy = "def solve(task, client):\n    print('debug: solving', task['task_id'])\n    return 1.0\n"
    folder = make_project(tmp_path / "noisy", {"python": "noisy:solve"}, {"noisy.py": noisy})
    argv = ["rollouts", "run", "--project", str(folder), "--n", "2", "--group-size", "1", "--json"]
    assert main(argv + gateway_args(gateway, store, tmp_path)) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["rollouts_by_status"] == {"succeeded": 2} and summary["rewards"] == 2
    assert "debug: solving train-0" in err
