"""The built-in example projects `examples/calc` and `examples/ledger`, which `--harness NAME` names."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster.project.config import PROJECT_FILE, Project, load_project
from lightning_dagster.project.errors import ProjectError
from lightning_dagster.project.tasks import TaskSet, load_tasks

if TYPE_CHECKING:
    from lightning_dagster.runner.harness_spec import HarnessSpec

# Found next to the package in a clone installed with `pip install -e .`.
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLES = ("calc", "ledger")


class UnknownExample(ProjectError):
    """No built-in example of that name (or the repository's examples folder is missing)."""


def example_file(name: str) -> Path:
    if name not in EXAMPLES:
        raise UnknownExample(EXAMPLES_DIR, [("", f"unknown example {name!r}; known: {', '.join(EXAMPLES)}")])
    file = EXAMPLES_DIR / name / PROJECT_FILE
    if not file.is_file():
        problem = f"{file} is missing: the examples ship with a clone of the repository (pip install -e .)"
        raise UnknownExample(EXAMPLES_DIR, [("", problem)])
    return file


def project_file(project: Path | str | None, harness: str | None) -> Path | str | None:
    """What a command's `--project` / `--harness NAME` pair names (None: the working directory's project)."""
    return example_file(harness) if harness is not None else project


@cache
def example_project(name: str) -> Project:
    return load_project(example_file(name))


@cache
def example_tasks(name: str) -> TaskSet:
    return load_tasks(example_project(name))


@cache
def example_harness(name: str) -> HarnessSpec:
    from lightning_dagster.project.harness import harness_spec

    return harness_spec(example_project(name))
