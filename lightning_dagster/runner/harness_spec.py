"""`HarnessSpec`, what the runner runs and the gate judges (a project's harness becomes one through
`project.harness.harness_spec`)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.settings import TrainingSettings

if TYPE_CHECKING:
    from lightning_dagster.runner.retry import RetryPolicy

Task = dict[str, Any]
# A judge scores an attempt that posted no reward: (task, transcript) -> reward; see `runner.rewards`.
Judge = Callable[[Task, list[dict[str, Any]]], float]


@dataclass(frozen=True)
class HarnessSpec:
    """Everything the runner needs to run a harness, and the gate to judge its evidence: `argv` (run in
    `cwd`, `env_map` copying task fields into variables) and/or the in-process `run_task`; `prepare(task,
    workdir)` makes a fresh destination per attempt, `verify(task)` re-reads it afterwards."""

    name: str
    expected_span_families: tuple[str, ...]
    argv: tuple[str, ...] | None = None
    run_task: Callable[..., float | None] | None = None
    verify: Callable[[Task], dict[str, Any]] | None = None
    prepare: Callable[[Task, Path], Task] | None = None
    cwd: Path | None = None
    env_map: dict[str, str] = field(default_factory=dict, hash=False)
    judge: Judge | None = None
    judge_name: str | None = None
    # The settings' defaults; a project's spec has its file's (`project.harness.harness_spec`).
    timeout_s: float = TrainingSettings.model_fields["attempt_timeout_s"].default
    max_attempts: int = TrainingSettings.model_fields["max_attempts"].default
    tools: list[dict[str, Any]] = field(default_factory=list, hash=False)
    model_names: tuple[str, ...] = ()  # if given, the only model names the gateway serves (else any)
    env_passthrough: tuple[str, ...] = ()  # variables a subprocess harness inherits beyond the allowlist
    # Of a subprocess's stdout, and of its stderr, per attempt (`runner.output`'s default, not imported:
    # the runner package imports this module).
    max_output_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.command() is None and self.run_task is None:
            raise ValueError(f"harness {self.name!r} needs a command (argv) or a run_task")
        if (self.judge is None) != (self.judge_name is None):
            raise ValueError(f"harness {self.name!r}: a judge and its judge_name go together")

    def command(self) -> list[str] | None:
        return list(self.argv) if self.argv else None

    def run_mode(self, requested: str) -> str:
        """The mode an attempt runs in: the requested one when the spec has both entry points."""
        if self.run_task is None:
            return "subprocess"
        if self.command() is None:
            return "inprocess"
        return requested

    def task_env(self, task: Task) -> dict[str, str]:
        """`env_map` applied to a task: strings as they are, any other value JSON-encoded."""
        return {
            name: value if isinstance(value, str) else json.dumps(value)
            for name, value in ((name, task.get(column)) for name, column in self.env_map.items())
        }

    def retry_policy(self, **overrides: Any) -> RetryPolicy:
        """The retry policy with this harness's timeout and attempt budget (`overrides` win)."""
        from lightning_dagster.runner.retry import RetryPolicy

        return RetryPolicy(**{"max_attempts": self.max_attempts, "timeout_s": self.timeout_s, **overrides})
