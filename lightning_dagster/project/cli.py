"""`lightning-dagster project check [--project PATH]`: validate a project (its command's script files too)
and print its summary; exit status 0 valid, 2 invalid. Also the `--project` option every command shares."""

from __future__ import annotations

import argparse
from typing import Any

from lightning_dagster.project.config import Project, load_project
from lightning_dagster.project.errors import ProjectError
from lightning_dagster.project.references import missing_scripts
from lightning_dagster.project.splits import SPLITS
from lightning_dagster.project.tasks import TaskSet, load_tasks
from lightning_dagster.settings import ProjectSettings, add_flags


def add_project_option(parser: argparse.ArgumentParser | Any) -> None:
    """`--project` (a parser or an argument group, e.g. exclusive with `--harness`)."""
    add_flags(parser, ProjectSettings, ["project"])


def command_project(args: argparse.Namespace) -> Project:
    """The project a command's `--project` / `--harness NAME` name, else the working directory's."""
    from lightning_dagster.project.examples import project_file

    # as given, not through `from_flags`: a command may declare --harness with a default of None
    return load_project(project_file(getattr(args, "project", None) or None, getattr(args, "harness", None)))


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="project_command", metavar="COMMAND")
    check = sub.add_parser("check", help="validate the project file and its tasks, print a summary")
    add_project_option(check)
    check.set_defaults(handler=_check)


def summary(project: Project, tasks: TaskSet) -> str:
    """The project at a glance: harness, model, judge, rows per split and family."""
    harness, training = project.harness, project.training
    how = " ".join(harness.command) if harness.command else (harness.python or harness.agl)
    model = project.model
    lines = [
        f"project {project.name} ({project.file})",
        f"harness: {harness.kind} {how}",
        f"  timeout {training.attempt_timeout_s:g}s, {training.max_attempts} attempt(s), "
        f"spans {', '.join(harness.expected_spans)}",
        f"reward: {project.reward or 'posted by the harness'}",
        f"model: {(model and model.path) or project.serving.upstream_url or 'embedded default'}"
        + (f", warm start {model.warm_start}" if model and model.warm_start else ""),
        f"policy: {project.gate.policy_path or 'packaged default'}",
        *_section_lines(project),
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


def _section_lines(project: Project) -> list[str]:
    """The settings the file sets (its `training:`, `serving:`, `gate:` keys), one line per section."""
    from lightning_dagster.project.sections import SECTIONS

    lines = []
    for name in SECTIONS:
        given = getattr(project, name).given()
        if given:
            lines.append(f"{name}: " + ", ".join(f"{key} {given[key]}" for key in sorted(given)))
    return lines


def _check(args: argparse.Namespace) -> int:
    project = command_project(args)
    tasks = load_tasks(project)
    print(summary(project, tasks))
    missing = missing_scripts(project.harness.command or (), project.root)
    if missing:  # a script the program runs: every rollout would fail on it
        why = [f"script {n!r} not found ({project.root / n} does not exist)" for n in missing]
        raise ProjectError(project.file, [("harness.command", problem) for problem in why])
    # The pipeline trains on train, compares on holdout and protected, and releases through canary.
    tasks.require_splits(SPLITS)
    print("ok")
    return 0
