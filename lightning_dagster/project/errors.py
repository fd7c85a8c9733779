"""The project's one error family: every message names the file, the dotted key and what is wrong."""

from __future__ import annotations

from pathlib import Path

from lightning_dagster.settings import UsageError


class ProjectError(ValueError, UsageError):
    """A project file (or a file it points to) that cannot be used. `problems` lists (dotted key, message)."""

    def __init__(self, file: Path | str, problems: list[tuple[str, str]]):
        self.file = Path(file)
        self.problems = problems
        self.keys = [key for key, _ in problems]
        detail = "; ".join(f"{key}: {message}" if key else message for key, message in problems)
        super().__init__(f"{self.file}: {detail}")


class TaskDataError(ProjectError):
    """The tasks file cannot be read or its rows break a rule; the message names the column and rows."""


class TaskFieldConflict(TaskDataError):
    """A row's own `task_id`, `family` or `split` column holds another value than the loader sets."""
