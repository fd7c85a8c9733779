"""Harness lookup for the runner and the pipeline, and the text corpus the engine trains its tokenizer on."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dagster.harnesses.calc import agent as calc_agent
from lightning_dagster.harnesses.calc import tasks as calc_tasks
from lightning_dagster.harnesses.ledger import agent as ledger_agent
from lightning_dagster.harnesses.ledger import environment as ledger_env
from lightning_dagster.harnesses.ledger import tasks as ledger_tasks
from lightning_dagster.harnesses.splits import SPLITS


class UnknownHarness(KeyError):
    """No harness registered under that name."""


@dataclass(frozen=True)
class HarnessSpec:
    """Everything the runner needs to run a harness, and the gate needs to judge its evidence.

    `argv` (optional) is the subprocess command line; by default `python -m <module>`, but any program in
    any language that reads the Agent Lightning environment works. `prepare(task, workdir)` (optional) sets
    up a fresh destination per attempt and returns the task the harness receives; `verify(task)` re-reads
    that destination afterwards. `expected_span_families` lists the span families (see `span_family`) every
    finished rollout must have.
    """

    name: str
    module: str
    run_task: Callable[..., float]
    make_tasks: Callable[[str, int, int], list[dict[str, Any]]]
    expected_span_families: tuple[str, ...]
    verify: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    argv: tuple[str, ...] | None = None
    prepare: Callable[[dict[str, Any], Path], dict[str, Any]] | None = None
    splits: tuple[str, ...] = field(default=SPLITS)

    def command(self) -> list[str]:
        return list(self.argv) if self.argv else [sys.executable, "-m", self.module]


_HARNESSES: dict[str, HarnessSpec] = {
    "calc": HarnessSpec(
        name="calc",
        module="lightning_dagster.harnesses.calc.agent",
        run_task=calc_agent.run_task,
        make_tasks=calc_tasks.make_tasks,
        expected_span_families=("llm", "reward"),
    ),
    "ledger": HarnessSpec(
        name="ledger",
        module="lightning_dagster.harnesses.ledger.agent",
        run_task=ledger_agent.run_task,
        make_tasks=ledger_tasks.make_tasks,
        # `effect` is the runner's record of `verify` after each attempt.
        expected_span_families=("llm", "reward", "effect"),
        verify=ledger_env.verify,
        prepare=ledger_env.prepare,
    ),
}


def harness_names() -> list[str]:
    return sorted(_HARNESSES)


def get_harness(name: str) -> HarnessSpec:
    try:
        return _HARNESSES[name]
    except KeyError:
        raise UnknownHarness(f"unknown harness {name!r}; known: {', '.join(harness_names())}") from None


def training_corpus(n_per_split: int = 200, seed: int = 0) -> list[str]:
    """Every kind of text the harnesses exchange: system prompts, tool schemas, questions, tool-call
    arguments as JSON, tool results and final answers. Deterministic, so the tokenizer is too."""
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
