"""`lightning-dagster rollouts run`: enqueue N rollouts of a project's harness and run them through a
gateway (default: a local one); `rollouts enqueue`: only queue them, for `lightning-dagster runner`. The
same `--run-id` resumes a run. Exit status: 0 ran, 1 no rollout succeeded, 2 bad arguments or project."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster import paths
from lightning_dagster.gateway.cli import add_removed_secret_option
from lightning_dagster.gateway.keys import SecretError, read_secret_file, refuse_env_secrets
from lightning_dagster.gateway.options import SERVING_FIELDS, flags_given, gateway_options
from lightning_dagster.model_folder import ModelFolderError, check_model_folder
from lightning_dagster.project.cli import add_project_option
from lightning_dagster.project.splits import SPLITS
from lightning_dagster.runner.execute import check_sandbox
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.runner.retry import RetryPolicy
from lightning_dagster.runner.summary import failure_lines
from lightning_dagster.settings import (
    ProjectSettings,
    ServingSettings,
    SettingsError,
    StoreSettings,
    TrainingSettings,
    UsageError,
    add_flags,
    from_flags,
)
from lightning_dagster.types import Rollout, new_id

if TYPE_CHECKING:
    from lightning_dagster.runner.transcript import Decode


def add_harness_options(parser: argparse.ArgumentParser) -> None:
    """Which project's harness, and the store (shared with `lightning-dagster runner`)."""
    which = parser.add_mutually_exclusive_group()
    add_flags(which, ProjectSettings, ["harness"])
    add_project_option(which)
    add_flags(parser, StoreSettings, ["url"], prefix="store")


# the serving settings that say how attempts run (the local gateway's are `options.SERVING_FIELDS`)
RUNNER_SETTINGS = ("runner_mode", "sandbox", "parallel")


def add_runner_options(parser: argparse.ArgumentParser) -> None:
    """How attempts run: gateway secret, serving settings and the retry policy (shared with the worker)."""
    parser.add_argument("--secret-file", help="file holding the gateway's attempt-key secret, mode 0600 "
                        "(-: read it from standard input)")  # fmt: skip
    add_removed_secret_option(parser)
    add_flags(parser, ServingSettings, list(RUNNER_SETTINGS))
    add_flags(parser, TrainingSettings, ["attempt_timeout_s", "max_attempts"])
    parser.add_argument("--heartbeat-timeout", type=float, help="seconds without a heartbeat after which "
                        "any runner's reaper ends an attempt unresponsive (default 30)")  # fmt: skip
    parser.add_argument("--backoff-max", type=float, help="cap of the infrastructure retries' exponential "
                        "backoff, and the longest claims pause while the gateway is down (default 30)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def serving_of(args: argparse.Namespace, command: str) -> ServingSettings:
    """The serving settings the command line gives (the others at their defaults)."""
    return from_flags(ServingSettings(), args, command=command)


def store_of(args: argparse.Namespace) -> str:
    return StoreSettings(url=getattr(args, "store_url", "")).resolved_url()


def _task_options(parser: argparse.ArgumentParser) -> None:
    add_harness_options(parser)
    parser.add_argument("--split", default="train", choices=SPLITS)
    parser.add_argument("--n", type=int, required=True, help="number of tasks")
    add_flags(parser, TrainingSettings, ["group_size", "seed"])
    parser.add_argument("--run-id", help="names the run (group ids RUN-gI); the same id again resumes its "
                        "unfinished rollouts instead of queuing new ones (default: a new id, printed)")  # fmt: skip


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    enqueue = sub.add_parser("enqueue", help="queue N rollouts for `lightning-dagster runner` workers")
    _task_options(enqueue)
    enqueue.set_defaults(handler=_enqueue)
    run = sub.add_parser("run", help="run N rollouts of a harness and print the summary")
    _task_options(run)
    add_runner_options(run)
    run.add_argument("--gateway", help="URL of a running gateway (default: a local one in this process)")
    run.add_argument("--model", type=Path, help="model directory for the local gateway (default: the "
                     "project's model.path or model.upstream, else <home>/models/base, built if absent)")  # fmt: skip
    add_flags(run, ServingSettings, list(SERVING_FIELDS))
    run.add_argument("--tokenizer", type=Path, help="with --upstream-url: the served model's tokenizer "
                     "folder; prompts then go upstream as exact token ids (token-in)")  # fmt: skip
    run.set_defaults(handler=_run)


def secret_of(args: argparse.Namespace) -> str | None:
    """The secret of the gateway given by `--gateway` (None for a local one, which makes its own)."""
    refuse_env_secrets()
    if not args.gateway:
        if args.secret_file:
            raise SecretError("--secret-file goes with --gateway (a local gateway makes its own secret)")
        return None
    if not args.secret_file:
        raise SecretError(
            "--gateway needs that gateway's secret: --secret-file PATH (mode 0600), or - for stdin"
        )
    return read_secret_file(args.secret_file)


def harness_of(args: argparse.Namespace) -> tuple[HarnessSpec, Any]:
    from lightning_dagster.project.cli import command_project
    from lightning_dagster.project.harness import harness_spec

    project = command_project(args)
    return harness_spec(project), project


def policy_of(args: argparse.Namespace, spec: HarnessSpec) -> RetryPolicy:
    """The harness's retry policy with the command line's overrides (raises `InvalidPolicy`)."""
    given = from_flags(TrainingSettings(), args).given()
    overrides = {
        "max_attempts": given.get("max_attempts"),
        "timeout_s": given.get("attempt_timeout_s"),
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "backoff_max_s": args.backoff_max,
    }
    if args.backoff_max is not None:  # a cap below the default first delay lowers that delay with it
        overrides["backoff_s"] = min(RetryPolicy.backoff_s, args.backoff_max)
    return spec.retry_policy(**{name: value for name, value in overrides.items() if value is not None})


def rollouts_of(
    args: argparse.Namespace, store: Any, spec: HarnessSpec, project: Any, **enqueue_kw: Any
) -> list[Rollout]:
    """The rollouts already queued under `--run-id` (a resumed run), else new ones."""
    from lightning_dagster.project import load_tasks
    from lightning_dagster.runner.enqueue import enqueue_tasks, run_rollouts

    tasks = load_tasks(project)
    tasks.require_splits([args.split])
    chosen = tasks.splits[args.split][: args.n]
    if args.run_id is None:
        args.run_id = new_id("run")
        print(
            f"run id: {args.run_id} (the same command with --run-id {args.run_id} resumes it)",
            file=sys.stderr,
        )
    # one group past the run's tasks: a run queued with a larger --n is another run, not this one's prefix
    found = run_rollouts(store, args.run_id, len(chosen) + 1)
    if found:
        _check_resumed(args, spec, chosen, found)
        return found
    return enqueue_tasks(
        store,
        spec,
        chosen,
        kind=args.split,
        group_size=args.group_size,
        seed=args.seed,
        tag=args.run_id,
        **enqueue_kw,
    )


class RunMismatch(ValueError, UsageError):
    """`--run-id` names a run queued with other settings than the command's."""


def _check_resumed(args: argparse.Namespace, spec: HarnessSpec, chosen: list, found: list[Rollout]) -> None:
    """Raise RunMismatch unless `found` is exactly what `enqueue_tasks` queues for this command."""
    from lightning_dagster.runner.enqueue import sampling_seed

    expected = Counter(
        (
            f"{args.run_id}-g{t}",
            task["task_id"],
            spec.name,
            args.split,
            sampling_seed(args.seed, task["task_id"], i),
        )
        for t, task in enumerate(chosen)
        for i in range(args.group_size)
    )
    queued = Counter(
        (r.group_id, r.task_id, r.harness, r.kind.value, r.metadata.get("sampling_seed")) for r in found
    )
    if queued == expected:
        return
    groups = Counter(r.group_id for r in found)
    differences = []
    for what, values, asked in (
        ("harness", {str(r.harness) for r in found}, spec.name),
        ("split", {r.kind.value for r in found}, args.split),
    ):
        if values != {asked}:
            differences.append(f"{what} {', '.join(sorted(values))}, not {asked}")
    if len(groups) != len(chosen):
        more = "more than " if len(groups) > len(chosen) else ""
        differences.append(f"{more}{min(len(groups), len(chosen))} task(s), not {len(chosen)} (--n)")
    sizes = sorted(set(groups.values()))
    if sizes != [args.group_size]:
        differences.append(f"groups of {', '.join(map(str, sizes))}, not {args.group_size} (--group-size)")
    raise RunMismatch(
        f"run {args.run_id} was queued with other settings: "
        f"{'; '.join(differences) or 'other tasks, or another --seed'}. "
        "Resume it with the command that started it, or give a new --run-id"
    )


def _task_shape(args: argparse.Namespace, command: str) -> None:
    """Check `--n` and resolve the group size and seed into `args` (raises SettingsError)."""
    shape = from_flags(TrainingSettings(), args, command=command)
    if args.n < 1:
        raise SettingsError(f"{command}: --n must be >= 1")
    args.group_size, args.seed = shape.group_size, shape.seed


def _enqueue(args: argparse.Namespace) -> int:
    from lightning_dagster.store import Store

    _task_shape(args, "rollouts enqueue")
    spec, project = harness_of(args)
    rollouts = rollouts_of(args, Store(store_of(args)), spec, project)
    print(json.dumps({"run_id": args.run_id, "rollouts": len(rollouts), "harness": spec.name}))
    return 0


def _run(args: argparse.Namespace) -> int:
    from lightning_dagster.gateway.local import LocalGateway
    from lightning_dagster.runner.runner import Runner
    from lightning_dagster.store import Store

    _task_shape(args, "rollouts run")
    serving = serving_of(args, "rollouts run")
    local = flags_given(args) + [
        f for f, v in (("--model", args.model), ("--tokenizer", args.tokenizer)) if v
    ]
    if args.gateway and local:
        raise SettingsError(
            f"rollouts run: {', '.join(local)} set the local gateway; --gateway uses a running one"
        )
    secret = secret_of(args)
    check_sandbox(serving.sandbox)
    if args.tokenizer is not None and not serving.upstream_url:
        raise SettingsError("rollouts run: --tokenizer goes with --upstream-url")
    if args.model is not None and serving.upstream_url:
        raise SettingsError(
            "rollouts run: --model is served by the embedded engine; with --upstream-url give the "
            "served model's --tokenizer"
        )
    spec, project = harness_of(args)
    if serving.sandbox != "none" and spec.run_mode(serving.runner_mode) == "inprocess":
        raise SettingsError(
            f"--sandbox {serving.sandbox} needs --runner-mode subprocess and a harness command"
        )
    policy = policy_of(args, spec)
    store = Store(store_of(args))

    def execute(url: str, key: str, resource_id: str | None, decode: Decode | None) -> int:
        rollouts = rollouts_of(args, store, spec, project, resource_id=resource_id)
        runner = Runner(
            store, url, secret=key, harness=spec, parallel=serving.attempts_at_once(), policy=policy,
            mode=serving.runner_mode, decode=decode, sandbox=serving.sandbox,
        )  # fmt: skip
        with _stdout_to_stderr():
            summary = runner.run([r.rollout_id for r in rollouts])
        for line in failure_lines(summary.failures):
            print(line, file=sys.stderr)
        print(summary.to_json() if args.json else _text(summary.to_dict()))
        if summary.rollouts_by_status.get("succeeded", 0) == 0:
            print(f"error: no rollout succeeded (0 of {summary.rollouts})", file=sys.stderr)
            return 1
        return 0

    if args.gateway:
        return execute(args.gateway.rstrip("/"), secret, None, None)
    from lightning_dagster.runner.service import model_resource

    model_dir, resource_id = args.model, None
    upstream_url, tokenizer = serving.upstream_url, args.tokenizer
    for folder, flag in ((model_dir, "--model"), (tokenizer, "--tokenizer")):
        if folder is not None:
            try:
                check_model_folder(folder, weights=flag == "--model")
            except ModelFolderError as err:  # a folder given is used as it is: never built over
                print(f"error: {flag}: {err}", file=sys.stderr)
                return 2
    if model_dir is None and not upstream_url:
        model_dir, upstream_url, tokenizer = _project_model(project)
    if not upstream_url:
        model_dir = model_dir or paths.models_dir() / "base"
        if not (model_dir / "config.json").exists():
            from lightning_dagster.engine.build import build_base_model, default_corpus

            build_base_model(model_dir, corpus=default_corpus())
        resource_id = model_resource(store, model_dir).resource_id
    options = gateway_options(
        serving.updated({"upstream_url": upstream_url or ""}), model_names=list(spec.model_names)
    )
    with LocalGateway(store, model_dir or tokenizer, options, resource_id=resource_id) as gateway:
        decode = gateway.codec.decode if gateway.codec is not None else None
        return execute(gateway.url, gateway.secret, resource_id, decode)


def _project_model(project: Any) -> tuple[Path | None, str | None, Path | None]:
    """(model folder, upstream URL, tokenizer) the project serves, as `train` does, said on stderr."""
    model, upstream = project.model, project.serving.upstream_url
    if model is not None and model.path is not None:
        print(f"model: {model.path} (the project's model.path)", file=sys.stderr)
        return model.path, None, None
    if upstream:
        print(f"model: {upstream} (the project's serving.upstream_url)", file=sys.stderr)
        return None, upstream, model.tokenizer if model is not None else None
    return None, None, None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """While the attempts run, standard output goes to standard error: stdout carries only the summary."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 to keep
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _text(summary: dict) -> str:
    keys = ("harness", "rollouts", "rollouts_by_status", "attempts_by_ending", "retries_by_kind", "spans",
            "llm_spans", "reward_mean", "missing_rewards", "token_in_share", "effects", "wall_s")  # fmt: skip
    return "\n".join(f"{k}: {summary[k]}" for k in keys)
