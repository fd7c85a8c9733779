"""`lightning-dagster train [--project PATH | --harness calc] [--steps N] [--nproc N] [--json] ...`: warm-start a
parent if there is none, run RL (`training.loop.train_rl`) on the project's train split, print the parent's
and the candidate's success on its holdout split. Other flags are generated from `lightning_dagster.settings`.
`--nproc N` runs the same command as N ranks under torch.distributed.run. Exit status 2 on a bad setting."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster import paths
from lightning_dagster.project.cli import add_project_option
from lightning_dagster.settings import (
    ProjectSettings,
    ServingSettings,
    SettingsError,
    StoreSettings,
    TrainingSettings,
    add_flags,
    flag_of,
    from_flags,
)

if TYPE_CHECKING:
    from lightning_dagster.project import Project
    from lightning_dagster.runner.harness_spec import HarnessSpec
    from lightning_dagster.runner.service import RolloutService
    from lightning_dagster.store import Store

# The pipeline's own settings (the gate's closed sets, the sensor's threshold) do nothing in `train`.
PIPELINE_ONLY = ("protected_tasks", "canary_tasks", "min_serve_rollouts")
TRAINING = [name for name in TrainingSettings.model_fields if name not in PIPELINE_ONLY]
# How rollouts run; the gateway itself is always a child process on loopback, as the pipeline's training stage
# serves, so its address, secret and upstream are not `train`'s.
SERVING = (
    "engine vllm_url vllm_args vllm_dtype vllm_enforce_eager engine_process engine_threads engine_device "
    "max_batch runner_mode sandbox parallel"
).split()


def register(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    add_flags(which, ProjectSettings, ["harness"])
    add_project_option(which)
    add_flags(parser, TrainingSettings, TRAINING)
    add_flags(parser, ServingSettings, SERVING)
    add_flags(parser, StoreSettings)
    parser.add_argument("--parent", type=Path, help="parent checkpoint (default: the store's warm start, "
                        "built from <home>/models/base if absent)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="candidate checkpoint directory")
    parser.add_argument("--metrics", type=Path, help="write per-step metrics and evaluations as JSONL")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.set_defaults(handler=_train, rank_argv=lambda args: _rank_argv(parser, args))


def _rank_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The `train` command line every rank runs: the options given, except --nproc."""
    argv = ["train"]
    for action in parser._actions:
        # a setting's flag not given is absent from `args` (its default is the setting's)
        if not action.option_strings or action.dest in ("help", "nproc") or not hasattr(args, action.dest):
            continue
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else action.option_strings[1])
        elif isinstance(action, argparse._StoreTrueAction):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
        elif action.default is argparse.SUPPRESS:  # an optional setting given as empty
            argv += [flag, "none"]
    return argv


def settings_of(
    args: argparse.Namespace, project: Project | None = None
) -> tuple[TrainingSettings, ServingSettings, StoreSettings]:
    """The settings `train` runs with: the flags given, over the project file's sections, over the defaults.
    Raises `SettingsError` naming the flag (or the section's key) of a bad value."""
    from lightning_dagster.project.sections import effective
    from lightning_dagster.training.configs import trainer_config
    from lightning_dagster.training.loss import LossConfigError

    training = from_flags(TrainingSettings(), args, command="train")
    serving = from_flags(ServingSettings(), args, command="train")
    store = from_flags(StoreSettings(), args, command="train")
    if project is not None:
        training, serving = effective(project, training), effective(project, serving)
    if training.group_size < 2:  # `rollouts run` may run groups of 1; RL learns only from differing rewards
        raise SettingsError(f"train: {flag_of('group_size')}: RL needs groups of 2 or more rollouts per task")
    try:
        trainer_config(training)  # the rules between settings (a constant normalization needs its constant)
    except LossConfigError as err:
        given = f"{flag_of('loss_normalization')} {training.loss_normalization}"
        raise SettingsError(
            f"train: {given}, {flag_of('loss_constant')} {training.loss_constant}: {err}"
        ) from None
    return training, serving, store


def find_or_build_parent(
    store: Store, project: Project, training: TrainingSettings, serving: ServingSettings, *, log
) -> tuple[Path, str | None]:
    """The store's warm-started parent for the project (its checkpoint still on disk), else a new warm start
    on its demonstrations; a project without demonstrations starts from its base model."""
    from lightning_dagster.training.configs import warm_start_config
    from lightning_dagster.training.warmstart import base_model, has_demos, warm_start

    if not has_demos(project):
        return base_model(project, training.seed), None
    for r in reversed(store.list_resources()):
        if r.metadata.get("role") == "warm_start" and r.metadata.get("project") == project.name:
            if (Path(r.uri) / "config.json").exists():
                return Path(r.uri), r.resource_id
    base, out = base_model(project, training.seed), paths.models_dir() / f"{project.name}-warm-start"
    result = warm_start(store, base, out, warm_start_config(project.file, training, serving), log=log)
    return result.model_dir, result.resource.resource_id


def sampling_service(
    store: Store,
    model_dir: Path,
    resource_id: str | None,
    harness: HarnessSpec,
    training: TrainingSettings,
    serving: ServingSettings,
) -> RolloutService:
    """What `train` samples through: the engine serving the weights it trains, its gateway a child process."""
    from lightning_dagster.gateway.options import serving_settings
    from lightning_dagster.runner.service import RolloutService
    from lightning_dagster.training.configs import lora_spec, retry_policy

    return RolloutService(
        store,
        model_dir,
        harness=harness,
        serving=serving_settings(serving, upstream_url=""),
        resource_id=resource_id,
        retry_policy=retry_policy(training, harness),
        child=True,
        reuse=True,
        lora=lora_spec(training),
    )


def _train(args: argparse.Namespace) -> int:
    from lightning_dagster.engine.build import checkpoint_hash
    from lightning_dagster.project import load_tasks
    from lightning_dagster.project.cli import command_project
    from lightning_dagster.project.harness import harness_spec
    from lightning_dagster.store import Store
    from lightning_dagster.training import distributed
    from lightning_dagster.training.loop import draw_pools, followed, join, train_rl
    from lightning_dagster.training.step import step_warnings
    from lightning_dagster.types import Resource

    settings_of(args)  # a bad flag is named before any project is read
    project = command_project(args)
    training, serving, store_settings = settings_of(args, project)
    tasks = load_tasks(project)
    tasks.require_splits(["train", "holdout"])  # before any model is built
    if training.nproc > 1 and distributed.launched_world_size() == 1:
        return distributed.launch(args.rank_argv(args), training.nproc)
    group = join(training.device)
    if followed(group):
        return 0
    started, store = time.perf_counter(), Store(store_settings.resolved_url())
    metrics_file = args.metrics.open("w") if args.metrics else None

    def log(entry: dict) -> None:
        if metrics_file:
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}
        print(json.dumps(rounded), file=sys.stderr)  # progress on stderr: stdout carries only the result
        for line in step_warnings(entry):
            print(line, file=sys.stderr)

    if args.parent:
        parent_dir, parent_id = args.parent, None
    else:
        parent_dir, parent_id = find_or_build_parent(store, project, training, serving, log=log)
    harness = harness_spec(project)
    out = args.out or paths.models_dir() / f"{project.name}-candidate-{time.strftime('%Y%m%dT%H%M%S')}"
    result = train_rl(
        parent_dir,
        training,
        draw_pools(tasks, training),
        lambda: sampling_service(store, parent_dir, parent_id, harness, training, serving),
        base_seed=training.seed,
        out_dir=out,
        log=log,
        group=group,
    )
    assert result.checkpoint is not None and result.parent is not None and result.candidate is not None
    metadata = {
        "role": "rl_candidate",
        "project": project.name,
        "training": training.model_dump(include=set(TRAINING)),
        "serving": serving.model_dump(include=set(SERVING)),
        "selection": result.selection,
    }
    ckpt = result.checkpoint
    candidate = store.add_resource(
        Resource(uri=str(ckpt), parent_id=parent_id, weights_hash=checkpoint_hash(ckpt), metadata=metadata)
    )
    summary = {
        "parent_success": result.parent["success"],
        "candidate_success": result.candidate["success"],
        "parent_greedy": result.parent.get("greedy"),
        "candidate_greedy": result.candidate.get("greedy"),
        "heldout_tasks": result.parent["tasks"],
        "steps": len(result.steps),
        "chosen_step": result.selection["chosen_step"],
        "kept_parent_cases": result.selection.get("kept_parent_cases"),
        "early_stop": result.selection["early_stop"],
        "kl_coef": result.selection["kl_coef"],
        "validation_tasks": result.selection["validation_tasks"],
        "seconds": time.perf_counter() - started,
        "rl_seconds": result.rl_seconds,
        "candidate_resource_id": candidate.resource_id,
        "parent_resource_id": parent_id,
        "checkpoint": str(result.checkpoint),
        "world_size": group.world_size if group is not None else 1,
        "engine": serving.engine,
        "adapter": training.adapter,
    }
    if metrics_file:
        metrics_file.close()
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0
