"""The calc harness: a safe calculator, answer extraction, the tool loop, the reward post, the demos."""

from __future__ import annotations

import time

import pytest

from lightning_dagster.harnesses import program
from lightning_dagster.harnesses.calc import agent
from lightning_dagster.harnesses.calc.demos import demo_messages, demo_tools
from lightning_dagster.harnesses.calc.generate import make_tasks
from tests.harnesses.scripted_llm import ScriptedLLM, say, tool_call


@pytest.mark.parametrize(
    ("expression", "value"),
    [("23+48", "71"), ("7*11-48", "29"), ("84/7", "12"), ("7/2", "3.5"), ("-(3-10)", "7"), ("2**10", "1024")],
)
def test_calculator_evaluates_arithmetic(expression, value):
    assert agent.calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('touch /tmp/pwned')", "unsupported syntax"),
        ("(1).__class__", "unsupported syntax"),
        ("open('/etc/passwd')", "unsupported syntax"),
        ("2**100000000", "exponent too large"),
        ("9**9**9", "exponent too large"),
        ("10**15*10**15", "out of range"),
        ("1/0", "division by zero"),
        ("'a'*3", "unsupported syntax"),
        ("1+" * 70 + "1", "longer than"),
        ("1 +", "not an arithmetic expression"),
    ],
)
def test_calculator_refuses_hostile_expressions_quickly(expression, message):
    started = time.perf_counter()
    with pytest.raises(agent.CalculatorError, match=message):
        agent.calculate(expression)
    assert time.perf_counter() - started < 0.1
    assert agent.run_tool("calculator", f'{{"expression": {expression!r}}}'.replace("'", '"')).startswith(
        "error:"
    )


def test_tool_errors_are_returned_to_the_model_not_raised():
    assert agent.run_tool("calculator", "{not json") == "error: arguments are not valid JSON"
    assert agent.run_tool("shell", '{"expression": "1"}') == "error: unknown tool 'shell'"
    assert agent.run_tool("calculator", '{"expression": "__import__(\\"os\\")"}').startswith(
        "error: unsupported"
    )


def test_answer_extraction_and_reward_are_correctness_only():
    assert agent.extract_answer("so ANSWER: 71") == 71.0
    assert agent.extract_answer("ANSWER: -3.5") == -3.5
    assert agent.extract_answer("71") is None
    assert agent.score(71.0, 71) == 1.0
    assert agent.score(70.0, 71) == 0.0
    assert agent.score(None, 71) == 0.0


def test_agent_loop_runs_the_tool_and_posts_the_reward():
    task = make_tasks("train", 1, 0)[0]
    replies = [tool_call("calculator", {"expression": task["expression"]}), say(f"ANSWER: {task['answer']}")]
    with ScriptedLLM(replies) as llm:
        reward = program.run_task(
            agent.solve, task, base_url=f"{llm.url}/v1", api_key="k-1", event_url=f"{llm.url}/v1/events"
        )
    assert reward == 1.0
    first, second = llm.requests
    assert first["messages"][-1] == {"role": "user", "content": task["question"]}
    assert first["tools"] == agent.TOOLS
    assert second["messages"][-1] == {
        "role": "tool",
        "tool_call_id": "call_0",
        "content": str(task["answer"]),
    }
    assert llm.events == [("Bearer k-1", {"event_type": "reward", "data": {"value": 1.0}})]


def test_agent_gives_zero_for_a_wrong_or_missing_answer():
    task = make_tasks("train", 1, 0)[0]
    with ScriptedLLM([say(f"ANSWER: {task['answer'] + 1}")]) as llm:
        assert (
            program.run_task(
                agent.solve, task, base_url=f"{llm.url}/v1", api_key="k", event_url=f"{llm.url}/v1/events"
            )
            == 0.0
        )
    # Tool calls until the turn limit, never an answer.
    replies = [tool_call("calculator", {"expression": "1+1"}, f"c{i}") for i in range(agent.MAX_TURNS)]
    with ScriptedLLM(replies) as llm:
        assert (
            program.run_task(
                agent.solve, task, base_url=f"{llm.url}/v1", api_key="k", event_url=f"{llm.url}/v1/events"
            )
            == 0.0
        )
    assert len(llm.requests) == agent.MAX_TURNS
    assert llm.events[0][1]["data"]["value"] == 0.0


def test_demo_is_a_perfect_episode_for_every_family():
    tasks = make_tasks("train", 200, 1)
    for task in tasks:
        messages = demo_messages(task)
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        call = messages[2]["tool_calls"][0]
        assert call["function"]["name"] == "calculator"
        assert messages[3]["content"] == agent.run_tool("calculator", call["function"]["arguments"])
        assert messages[3]["tool_call_id"] == call["id"]
        assert agent.score(agent.extract_answer(messages[4]["content"]), task["answer"]) == 1.0
    assert demo_tools() == agent.TOOLS
    assert {t["family"] for t in tasks} == {"add", "sub", "mul", "div", "two_step"}


def _posted(task, reply, workdir):
    """`prepare` a fresh destination, run the agent on one scripted reply, return `verify`'s re-read."""
    from lightning_dagster.harnesses.calc.environment import prepare, verify

    prepared = prepare(task, workdir)
    with ScriptedLLM([say(reply)]) as llm:
        program.run_task(
            agent.solve, prepared, base_url=f"{llm.url}/v1", api_key="k", event_url=f"{llm.url}/v1/events"
        )
    return prepared, verify(prepared)


def test_the_agent_posts_its_answer_where_prepare_says_and_verify_rereads_it(tmp_path):
    task = make_tasks("canary", 1, 0)[0]
    prepared, right = _posted(task, f"ANSWER: {task['answer']}", tmp_path / "a")
    assert prepared["answer_path"] == str(tmp_path / "a" / "answer.json") and "answer_path" not in task
    assert right == {
        "verified": True, "effect_ok": True, "harmful_effect": False, "posted": task["answer"], "reason": "ok"
    }  # fmt: skip
    _, wrong = _posted(task, f"ANSWER: {task['answer'] + 1}", tmp_path / "b")
    assert wrong["verified"] is True and wrong["effect_ok"] is False and wrong["harmful_effect"] is False
    assert wrong["reason"] == f"wrong answer {float(task['answer'] + 1)!r}"
    _, none = _posted(task, "I do not know", tmp_path / "c")  # the destination holds prepare's null
    assert none["verified"] is True and none["effect_ok"] is False and none["reason"] == "no answer posted"
    # A second attempt in the same folder starts from a fresh destination, not the last attempt's answer.
    from lightning_dagster.harnesses.calc.environment import prepare, verify

    assert verify(prepare(task, tmp_path / "a"))["effect_ok"] is False
    # Something other than a number at the destination is read, and is not the answer.
    odd = prepare(task, tmp_path / "d")
    (tmp_path / "d" / "answer.json").write_text(f'"{task["answer"]}"')
    assert verify(odd)["verified"] is True and verify(odd)["effect_ok"] is False


def test_an_unreadable_destination_is_not_verified_and_its_harm_unknown(tmp_path):
    from lightning_dagster.harnesses.calc.environment import prepare, verify

    task = make_tasks("canary", 1, 0)[0]
    gone = prepare(task, tmp_path / "gone")
    (tmp_path / "gone" / "answer.json").unlink()
    garbled = prepare(task, tmp_path / "garbled")
    (tmp_path / "garbled" / "answer.json").write_text("{not json")
    for broken in (gone, garbled, task):  # `task`: never prepared, it names no destination
        result = verify(broken)
        assert result["verified"] is False and result["effect_ok"] is False and result["harmful_effect"] is None
        assert result["reason"].startswith("unreadable: ")


def test_without_a_destination_the_agent_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = make_tasks("train", 1, 0)[0]
    with ScriptedLLM([say(f"ANSWER: {task['answer']}")]) as llm:
        program.run_task(
            agent.solve, task, base_url=f"{llm.url}/v1", api_key="k", event_url=f"{llm.url}/v1/events"
        )
    assert list(tmp_path.iterdir()) == []


def test_the_calc_example_project_wires_prepare_and_verify():
    from lightning_dagster.harnesses.calc import environment
    from lightning_dagster.project.examples import example_harness

    spec = example_harness("calc")
    assert spec.prepare is environment.prepare and spec.verify is environment.verify
