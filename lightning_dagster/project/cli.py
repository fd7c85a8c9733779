"""`lightning-dagster project check [--project PATH]`: load and validate a project, print its summary.
Exit status: 0 valid, 2 invalid (the message names the file and key).

`add_project_option` and `exits_2_on_project_error` give every sub-command that takes `--project` the
same option and the same handling of a bad project.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from lightning_dagster.project.config import PROJECT_FILE, Project, load_project
from lightning_dagster.project.errors import ProjectError
from lightning_dagster.project.splits import SPLITS
from lightning_dagster.project.tasks import TaskSet, load_tasks

Handler = Callable[[argparse.Namespace], int]


def add_project_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--project",
        type=Path,
        default=None,
        help=f"the project file or its folder (default: ./{PROJECT_FILE})",
    )


def exits_2_on_project_error(handler: Handler) -> Handler:
    """Wrap a sub-command handler: a ProjectError becomes its message on stderr and exit status 2."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ProjectError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2

    return run


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="project_command", metavar="COMMAND")
    check = sub.add_parser("check", help="validate the project file and its tasks, print a summary")
    add_project_option(check)
    check.set_defaults(handler=_check)


def summary(project: Project, tasks: TaskSet) -> str:
    """The project at a glance: harness, where the model and judge come from, rows per split and family."""
    harness = project.harness
    how = " ".join(harness.command) if harness.command else (harness.python or harness.agl)
    model = project.model
    lines = [
        f"project {project.name} ({project.file})",
        f"harness: {harness.kind} {how}",
        f"  timeout {harness.timeout_s:g}s, {harness.max_attempts} attempt(s), spans {', '.join(harness.expected_spans)}",
        f"reward: {project.reward or 'posted by the harness'}",
        f"model: {(model and (model.path or model.upstream)) or 'embedded default'}"
        + (f", warm start {model.warm_start}" if model and model.warm_start else ""),
        f"policy: {project.policy or 'packaged default'}",
        f"tasks: {tasks.file} ({len(tasks)} rows, hash {tasks.content_hash})",
    ]
    families = sorted({task["family"] for split in SPLITS for task in tasks.splits[split]})
    width = max([len(name) for name in families] + [5])
    lines.append(f"  {'split':<10} {'rows':>{width}} " + " ".join(f"{name:>{width}}" for name in families))
    for split in SPLITS:
        counts = tasks.families(split)
        cells = " ".join(f"{counts[name]:>{width}}" for name in families)
        lines.append(f"  {split:<10} {len(tasks.splits[split]):>{width}} {cells}")
    return "\n".join(lines)


@exits_2_on_project_error
def _check(args: argparse.Namespace) -> int:
    project = load_project(args.project)
    tasks = load_tasks(project)
    print(summary(project, tasks))
    # The pipeline trains on train, compares on holdout and protected, and releases through canary.
    tasks.require_splits(SPLITS)
    print("ok")
    return 0
