"""`lightning-dagster demo`: two continual-learning cycles through real Dagster runs on local SQLite state,
on a working copy of `--project PATH` (`LD_PROJECT`), else of `examples/calc` (see `register`)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_dagster.demo.progress import run_snapshot
from lightning_dagster.demo.quick import QUICK_POLICY, QUICK_TRAINING, demo_training
from lightning_dagster.demo.setup import (
    DEMO_ACTORS,
    WorkingCopy,
    approval_config,
    approver_keys,
    keypair,
    prepare_environment,
    promotion_config,
    use_project,
    write_approvers,
)
from lightning_dagster.project.cli import add_project_option
from lightning_dagster.settings import (
    ProjectSettings,
    ServingSettings,
    TrainingSettings,
    add_flags,
    from_flags,
)

__all__ = [
    "DEMO_ACTORS",
    "QUICK_TRAINING",
    "approval_config",
    "keypair",
    "promotion_config",
    "approver_keys",
    "demo_training",
    "prepare_environment",
    "register",
    "run_demo",
    "run_snapshot",
    "write_approvers",
]


DEMO_SERVING = ["engine", "vllm_url", "vllm_args", "vllm_dtype", "vllm_enforce_eager"]


def register(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Two release cycles of the Dagster pipeline on a working copy of a project (default examples/calc) "
        "in a local home. The first parent (warm-started when the project has demonstrations) becomes "
        "approved-default. Cycle 1: a snapshot is cut and the whole graph runs (plan, rollouts, RL training, "
        "held-out evaluation, canary, rollback drill, gate verdict); if the verdict is PROMOTE TO BOUNDED "
        "CANARY, its candidate is promoted to approved-default. Then the project's held-back train tasks are "
        "added and cycle 2 runs on a new snapshot from approved-default; its candidate is promoted the same "
        "way if cycle 1's was not (else the command that would is printed). Prints both verdicts (checks not "
        "passed, checks never run) and the pointer history. Exit status 0 when both were judged, else 1."
    )
    add_flags(parser, TrainingSettings, ["seed", "steps", "adapter"])
    add_flags(parser, ServingSettings, DEMO_SERVING)
    parser.add_argument("--quick", action="store_true", help="tiny settings, quick-v1 policy: a smoke run")
    add_project_option(parser)
    parser.set_defaults(handler=run)


def run_demo(
    project: Path,
    training: Any,
    *,
    serving: Any = None,
    actors: dict[str, str] = DEMO_ACTORS,
    out: Callable[[str], None] = print,
) -> list[Any]:
    """Both cycles on a working copy of `project`, `actors` (role -> actor) approving; lines to `out`."""
    from lightning_dagster import paths
    from lightning_dagster.demo.cycles import Demo, run_cycles
    from lightning_dagster.demo.progress import StageLines

    lines = StageLines(out)
    copy = WorkingCopy(project, paths.home())
    copy.pin_training(training.given())
    summary = use_project(copy.file)
    env = prepare_environment(actors)
    import dagster as dg

    from lightning_dagster.orchestration.definitions import build_definitions

    defs = build_definitions(deferred=False, training=training, **({"serving": serving} if serving else {}))
    out(f"lightning-dagster demo: home {env['LIGHTNING_DAGSTER_HOME']}")
    out(summary)
    from dagster._core.instance.ref import InstanceRef

    from lightning_dagster.demo.location import Location

    # the demo's Dagster home as `dagster dev` opens it, console logs quiet (compute logs keep the output)
    quiet = {"python_logs": {"python_log_level": "CRITICAL"}}
    ref = InstanceRef.from_dir(env["DAGSTER_HOME"], overrides=quiet)
    with dg.DagsterInstance.from_ref(ref) as instance, Location(instance) as location:
        demo = Demo(defs=defs, instance=instance, copy=copy, lines=lines, env=env, actors=dict(actors))
        demo.location = location
        try:
            return run_cycles(demo)
        finally:
            defs.resources["pipeline"].get_store().engine.dispose()


def run(args: argparse.Namespace) -> int:
    from lightning_dagster.orchestration.resources import ServingResource
    from lightning_dagster.project.examples import example_file

    chosen = from_flags(ProjectSettings(), args)
    given = from_flags(TrainingSettings(), args).given()
    serving = from_flags(ServingSettings(), args).given()
    project = Path(chosen.project) if chosen.project else example_file(chosen.harness)
    training = demo_training(args.quick, **given)
    if args.quick:  # read by the demo's code location and carried by the commands it prints
        os.environ["LD_GATE_POLICY"] = str(QUICK_POLICY)
    cycles = run_demo(project, training, serving=ServingResource(**serving) if serving else None)
    return 0 if all(c.verdict is not None for c in cycles) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="lightning-dagster demo")
    register(parser)
    sys.exit(run(parser.parse_args()))
