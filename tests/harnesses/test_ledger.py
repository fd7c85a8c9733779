"""The ledger harness: effects verified by re-querying the database; a delete is flagged harmful."""

from __future__ import annotations

import sqlite3

from lightning_dagster.harnesses import program
from lightning_dagster.harnesses.ledger import agent
from lightning_dagster.harnesses.ledger.environment import prepare, verify
from lightning_dagster.harnesses.ledger.generate import make_tasks
from tests.harnesses.scripted_llm import ScriptedLLM, say, tool_call


def _rows(db_path: str) -> dict[str, float]:
    with sqlite3.connect(db_path) as conn:
        return dict(conn.execute("SELECT name, balance FROM accounts").fetchall())


def test_prepare_writes_the_initial_rows_fresh_each_time(tmp_path):
    task = make_tasks("train", 1, 0)[0]
    prepared = prepare(task, tmp_path)
    agent.call_tool(prepared["db_path"], "set_balance", {"account": task["account"], "amount": 1})
    assert prepare(task, tmp_path)["db_path"] == prepared["db_path"]
    assert _rows(prepared["db_path"]) == task["accounts"]


def test_verify_reads_the_destination_not_the_agents_word(tmp_path):
    task = prepare(make_tasks("canary", 1, 0)[0], tmp_path)
    assert verify(task) | {"observed": None} == {
        "verified": True, "effect_ok": False, "harmful_effect": False, "deleted": [], "observed": None,
        "reason": "wrong rows",
    }  # fmt: skip
    agent.call_tool(task["db_path"], "set_balance", {"account": task["account"], "amount": task["target"]})
    result = verify(task)
    assert result["effect_ok"] and not result["harmful_effect"]
    assert result["observed"][task["account"]] == task["target"]
    # Touching another row spoils the effect even though the target row is right.
    other = next(name for name in task["accounts"] if name != task["account"])
    agent.call_tool(task["db_path"], "set_balance", {"account": other, "amount": -1})
    assert verify(task)["effect_ok"] is False


def test_a_deleted_row_is_flagged_harmful(tmp_path):
    task = prepare(make_tasks("protected", 1, 0)[0], tmp_path)
    assert agent.call_tool(task["db_path"], "delete_account", {"account": task["account"]}) == "deleted"
    result = verify(task)
    assert result == result | {"verified": True, "effect_ok": False, "harmful_effect": True}
    assert result["deleted"] == [task["account"]]


def test_an_unreadable_destination_is_unverified_not_healthy(tmp_path):
    task = make_tasks("canary", 1, 0)[0] | {"db_path": str(tmp_path / "missing.db")}
    result = verify(task)
    assert result["verified"] is False and result["effect_ok"] is False and result["harmful_effect"] is None
    assert not (tmp_path / "missing.db").exists()  # verifying must not create the destination


def test_tools_refuse_bad_calls_with_messages(tmp_path):
    task = prepare(make_tasks("train", 1, 0)[0], tmp_path)
    db = task["db_path"]
    assert agent.run_tool(db, "read_balance", '{"account": "nobody"}') == "error: no account 'nobody'"
    assert agent.run_tool(db, "set_balance", f'{{"account": "{task["account"]}", "amount": "x"}}') == (
        "error: amount must be a number"
    )
    assert agent.run_tool(db, "drop_table", f'{{"account": "{task["account"]}"}}').startswith(
        "error: unknown tool"
    )
    assert agent.run_tool(db, "read_balance", "[]") == "error: arguments must be a JSON object"
    assert _rows(db) == task["accounts"]


def test_agent_reward_comes_from_requerying_the_database(tmp_path):
    task = prepare(make_tasks("train", 1, 2)[0], tmp_path / "a")
    replies = [
        tool_call("read_balance", {"account": task["account"]}),
        tool_call("set_balance", {"account": task["account"], "amount": task["target"]}, "call_1"),
        say("DONE"),
    ]
    with ScriptedLLM(replies) as llm:
        reward = program.run_task(
            agent.solve, task, base_url=f"{llm.url}/v1", api_key="k", event_url=f"{llm.url}/v1/events"
        )
    assert reward == 1.0 and llm.events[0][1]["data"]["value"] == 1.0
    assert llm.requests[1]["messages"][-1]["content"] == f"{task['accounts'][task['account']]:g}"

    protected = prepare(make_tasks("protected", 1, 2)[0], tmp_path / "b")
    replies = [tool_call("delete_account", {"account": protected["account"]}), say("DONE")]
    with ScriptedLLM(replies) as llm:
        reward = program.run_task(
            agent.solve, protected, base_url=f"{llm.url}/v1", api_key="k", event_url=f"{llm.url}/v1/events"
        )
    assert reward == 0.0
    assert verify(protected)["harmful_effect"] is True
