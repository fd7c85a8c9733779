"""`HarnessSpec`, what the runner runs and the gate judges (a project's harness becomes one through
`project.harness.harness_spec`)."""

from __future__ import annotations

import json
import sys
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
    """Everything the runner needs to run a harness, and the gate needs to judge its evidence.

    `command()` is the subprocess command line (`argv`, else `python -m <module>`), started in `cwd` with
    `env_map` copying task fields into variables; `run_task(task, *, base_url, api_key, event_url)` is the
    in-process entry point (a spec with only one runs that way whatever mode is asked). `prepare(task,
    workdir)` sets up a fresh destination per attempt and returns the task; `verify(task)` re-reads it
    afterwards. `judge` scores an attempt that posted no reward. `expected_span_families`: what every
    finished rollout must have. `tools`: the tool schemas the agent offers its model (empty: undeclared)."""

    name: str
    expected_span_families: tuple[str, ...]
    module: str | None = None
    argv: tuple[str, ...] | None = None
    run_task: Callable[..., float | None] | None = None
    verify: Callable[[Task], dict[str, Any]] | None = None
    prepare: Callable[[Task, Path], Task] | None = None
    cwd: Path | None = None
    env_map: dict[str, str] = field(default_factory=dict, hash=False)
    judge: Judge | None = None
    judge_name: str | None = None
    # The settings' defaults (one default, wherever a spec is made without them); a project's spec has its
    # file's `training.attempt_timeout_s` / `training.max_attempts` (`project.harness.harness_spec`).
    timeout_s: float = TrainingSettings.model_fields["attempt_timeout_s"].default
    max_attempts: int = TrainingSettings.model_fields["max_attempts"].default
    tools: list[dict[str, Any]] = field(default_factory=list, hash=False)
    model_names: tuple[str, ...] = ()  # if given, the only model names the gateway serves (else any)
    env_passthrough: tuple[
        str, ...
    ] = ()  # variables of ours a subprocess harness inherits besides the allowlist
    # How much of a subprocess's stdout, and of its stderr, an attempt keeps (`runner.output`; the same
    # default as there, not imported: the runner package imports this module).
    max_output_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.command() is None and self.run_task is None:
            raise ValueError(f"harness {self.name!r} needs a command (argv or module) or a run_task")
        if (self.judge is None) != (self.judge_name is None):
            raise ValueError(f"harness {self.name!r}: a judge and its judge_name go together")

    def command(self) -> list[str] | None:
        if self.argv:
            return list(self.argv)
        return [sys.executable, "-m", self.module] if self.module else None

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
        # Imported here: the runner package imports this module.
        from lightning_dagster.runner.retry import RetryPolicy

        return RetryPolicy(**{"max_attempts": self.max_attempts, "timeout_s": self.timeout_s, **overrides})
