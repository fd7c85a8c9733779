"""`lightning-dagster train [--project PATH | --harness calc] [--steps N] [--nproc N] [--json]`: warm-start a
parent if there is none, run RL on the project's train split through the embedded gateway and runner, print
the parent's and the candidate's success on its holdout split. `--nproc N` runs the same command as N ranks
under torch.distributed.run (training.distributed). Exit status 2 on a bad project."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster import paths
from lightning_dagster.project.cli import add_project_option, exits_2_on_project_error
from lightning_dagster.project.examples import EXAMPLES
from lightning_dagster.training.selection import ValidationSettings

if TYPE_CHECKING:
    from lightning_dagster.project import Project
    from lightning_dagster.store import Store


def register(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--harness", choices=EXAMPLES, help="a built-in example project (examples/NAME)")
    add_project_option(which)
    parser.add_argument("--steps", type=int, default=40, help="RL steps (one optimizer update each)")
    parser.add_argument("--tasks-per-step", type=int, default=16)
    parser.add_argument("--group", type=int, default=16, help="rollouts per task (GRPO group)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--heldout", type=int, default=300, help="held-out tasks per evaluation")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loss-normalization", default="token_mean",
                        help="how per-token losses are weighted: token_mean, seq_mean_token_mean (each rollout "
                        "weighs one) or constant (Dr. GRPO, needs --loss-constant); see training.loss")  # fmt: skip
    parser.add_argument("--loss-constant", type=float, default=None,
                        help="the fixed denominator of --loss-normalization constant")  # fmt: skip
    parser.add_argument("--kl-coef", type=float, default=None,
                        help="weight of the k3 KL to the exact parent in the RL loss (0: off; default: "
                        "training.loss.KL_COEF)")  # fmt: skip
    parser.add_argument("--validation-tasks", type=int, default=ValidationSettings.tasks,
                        help="train-split tasks outside the train pool each checkpoint is judged on greedily; "
                        "the proposed checkpoint keeps every one the parent solved (0: the last checkpoint)")  # fmt: skip
    parser.add_argument("--validation-every", type=int, default=ValidationSettings.every,
                        help="judge a checkpoint every N steps (and the last)")  # fmt: skip
    parser.add_argument("--validation-patience", type=int, default=ValidationSettings.patience,
                        help="stop after N validation evaluations in a row that regressed (0: never)")  # fmt: skip
    parser.add_argument("--serving", choices=("thread", "process"), default="process",
                        help="the gateway + engine in this process or in a child process")  # fmt: skip
    parser.add_argument("--runner-mode", choices=("inprocess", "subprocess"), default="inprocess",
                        help="harness attempts in this process or as subprocesses")  # fmt: skip
    parser.add_argument("--parent", type=Path, help="parent checkpoint (default: the store's warm start, "
                        "built from <home>/models/base if absent)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="candidate checkpoint directory")
    parser.add_argument("--store", help="store URL (default: paths.store_url())")
    parser.add_argument("--metrics", type=Path, help="write per-step metrics and evaluations as JSONL")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--nproc", type=int, default=1,
                        help="training processes (DistributedDataParallel ranks: gloo on CPU, NCCL on GPU); "
                        "rank 0 samples, evaluates and saves")  # fmt: skip
    parser.add_argument("--device", default="auto",
                        help="where the trainer runs: auto (CUDA when present, bf16 autocast; else CPU), cpu, "
                        "cuda")  # fmt: skip
    parser.set_defaults(handler=_train, rank_argv=lambda args: _rank_argv(parser, args))


def _rank_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The `train` command line every rank runs: the options given, except --nproc."""
    argv = ["train"]
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or action.dest in ("help", "nproc") or value == action.default:
            continue
        flag = action.option_strings[-1]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv


def find_or_build_parent(store: Store, project: Project, *, seed: int, log) -> tuple[Path, str | None]:
    """The store's warm-started parent for the project (its checkpoint still on disk), else a new warm start
    on its demonstrations; a project without demonstrations starts from its base model."""
    from lightning_dagster.training.warmstart import WarmStartConfig, base_model, has_demos, warm_start

    if not has_demos(project):
        return base_model(project, seed), None
    for r in reversed(store.list_resources()):
        if r.metadata.get("role") == "warm_start" and r.metadata.get("project") == project.name:
            if (Path(r.uri) / "config.json").exists():
                return Path(r.uri), r.resource_id
    result = warm_start(
        store,
        base_model(project, seed),
        paths.models_dir() / f"{project.name}-warm-start",
        WarmStartConfig(project=str(project.file), seed=seed),
        log=log,
    )
    return result.model_dir, result.resource.resource_id


@exits_2_on_project_error
def _train(args: argparse.Namespace) -> int:
    import torch

    from lightning_dagster.engine.build import checkpoint_hash
    from lightning_dagster.engine.engine import resolve_device
    from lightning_dagster.project import load_tasks
    from lightning_dagster.project.cli import command_project
    from lightning_dagster.store import Store
    from lightning_dagster.training import distributed
    from lightning_dagster.training.loop import RLConfig, StepSettings, train_rl
    from lightning_dagster.training.loss import LossConfig, LossConfigError
    from lightning_dagster.training.selection import ValidationConfigError
    from lightning_dagster.training.trainer import Trainer, TrainerConfig
    from lightning_dagster.types import Resource

    if args.steps < 1 or args.group < 2 or args.tasks_per_step < 1 or args.heldout < 1 or args.nproc < 1:
        print(
            "error: --steps, --tasks-per-step, --heldout, --nproc must be >= 1 and --group >= 2",
            file=sys.stderr,
        )
        return 2
    try:
        kl = {} if args.kl_coef is None else {"kl_coef": args.kl_coef}
        loss = LossConfig(normalization=args.loss_normalization, constant=args.loss_constant, **kl)
        validation = ValidationSettings(
            tasks=args.validation_tasks, every=args.validation_every, patience=args.validation_patience
        )
    except (LossConfigError, ValidationConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    project = command_project(args)
    load_tasks(project).require_splits(["train", "holdout"])  # before any model is built
    if args.nproc > 1 and distributed.launched_world_size() == 1:
        return distributed.launch(args.rank_argv(args), args.nproc)
    group = distributed.join(resolve_device(args.device)) if distributed.launched_world_size() > 1 else None
    trainer_config = TrainerConfig(lr=args.lr, loss=loss, device=args.device)
    torch.manual_seed(args.seed)
    if group is not None and not group.leader:  # a follower: rank 0 names the parent, then sends each step
        parent_dir, _ = distributed.broadcast(None, group)
        distributed.follow(Trainer(parent_dir, trainer_config, group=group))
        return 0
    started = time.perf_counter()
    store = Store(args.store)
    metrics_file = args.metrics.open("w") if args.metrics else None

    def log(entry: dict) -> None:
        if metrics_file:
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()
        if not args.json:
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()}))

    if args.parent:
        parent_dir, parent_id = args.parent, None
    else:
        parent_dir, parent_id = find_or_build_parent(store, project, seed=args.seed, log=log)
    if group is not None:
        distributed.broadcast((parent_dir, parent_id), group)
    rl = RLConfig(
        project=str(project.file),
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        step=StepSettings(group_size=args.group),
        heldout_tasks=args.heldout,
        eval_every=args.eval_every,
        validation=validation,
        seed=args.seed,
        serving=args.serving,
        runner_mode=args.runner_mode,
        trainer=trainer_config,
    )
    out = args.out or paths.models_dir() / f"{project.name}-candidate-{time.strftime('%Y%m%dT%H%M%S')}"
    result = train_rl(store, parent_dir, rl, parent_resource_id=parent_id, out_dir=out, log=log, group=group)
    assert result.checkpoint is not None
    candidate = store.add_resource(
        Resource(
            uri=str(result.checkpoint),
            parent_id=parent_id,
            weights_hash=checkpoint_hash(result.checkpoint),
            metadata={
                "role": "rl_candidate",
                "project": project.name,
                "rl": rl.to_dict(),
                "selection": result.selection,
            },
        )
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
    }
    if metrics_file:
        metrics_file.close()
    if args.json:
        print(json.dumps(summary))
    else:
        for k, v in summary.items():
            print(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")
    return 0
