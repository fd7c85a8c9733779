"""The text the example agents exchange, which the embedded default model's tokenizer is trained on:
`scripts/make_example_data.py` writes it to `lightning_dagster/engine/corpus.json` for the core."""

from __future__ import annotations

import json

from lightning_dagster.harnesses.calc import agent as calc_agent
from lightning_dagster.harnesses.calc import generate as calc_tasks
from lightning_dagster.harnesses.ledger import agent as ledger_agent
from lightning_dagster.harnesses.ledger import generate as ledger_tasks
from lightning_dagster.project.splits import SPLITS


def training_corpus(n_per_split: int = 200, seed: int = 0) -> list[str]:
    """Every kind of text the harnesses exchange; deterministic, so the tokenizer is too."""
    texts: list[str] = []
    for agent in (calc_agent, ledger_agent):
        texts += [agent.SYSTEM_PROMPT, json.dumps(agent.TOOLS)]
        texts += [tool["function"]["name"] for tool in agent.TOOLS]
    for split in SPLITS:
        for task in calc_tasks.make_tasks(split, n_per_split, seed):
            result = calc_agent.calculate(task["expression"])
            texts += [
                task["question"],
                json.dumps({"expression": task["expression"]}),
                result,
                f"ANSWER: {calc_agent.format_number(task['answer'])}",
            ]
        for task in ledger_tasks.make_tasks(split, n_per_split, seed):
            account, target = task["account"], task["target"]
            texts += [
                task["question"],
                json.dumps({"account": account}),
                json.dumps({"account": account, "amount": target}),
                f"{task['accounts'][account]:g}",
                "ok",
                "DONE",
            ]
    texts += ["error: unknown tool", "error: arguments are not valid JSON", "deleted"]
    return texts
