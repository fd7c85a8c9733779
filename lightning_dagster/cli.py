"""The `lightning-dagster` command: each package registers its own sub-commands."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# (sub-command, module providing `register(subparsers)`); modules are imported lazily so that
# `lightning-dagster gate ...` does not pay for torch or Dagster imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "engine": ("lightning_dagster.engine.cli", "build or inspect the embedded policy model"),
    "gateway": ("lightning_dagster.gateway.cli", "serve the OpenAI-compatible LLM proxy"),
    "rollouts": ("lightning_dagster.runner.cli", "run harness rollouts through a gateway"),
    "runner": ("lightning_dagster.runner.worker", "a fleet worker: claim and run queued rollouts"),
    "train": ("lightning_dagster.training.cli", "warm-start a parent and train a candidate with RL"),
    "gate": ("lightning_dagster.gate.cli", "evaluate an update receipt under a policy"),
    "registry": ("lightning_dagster.release.cli", "candidate lineage and the two pointers in MLflow"),
    "init": ("lightning_dagster.project.scaffold", "write a starter project into a new folder"),
    "project": ("lightning_dagster.project.cli", "validate a project file and summarize its tasks"),
    "loop": ("lightning_dagster.pipeline.cli", "the continual-learning loop: status, history, signed resume"),
    "demo": (
        "lightning_dagster.demo",
        "two release cycles of the Dagster pipeline on a project (by default examples/calc); cycle 1's "
        "candidate is promoted when the gate says so",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="lightning-dagster", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in COMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    cmd_parser = argparse.ArgumentParser(prog=f"lightning-dagster {name}", description=COMMANDS[name][1])
    module.register(cmd_parser)
    args = cmd_parser.parse_args(argv[1:])
    handler = getattr(args, "handler", None)
    if handler is None:
        cmd_parser.print_help()
        return 2
    from lightning_dagster.model_folder import ModelFolderError
    from lightning_dagster.settings import UsageError
    from lightning_dagster.store.errors import StoreUnavailable

    try:
        status = int(handler(args) or 0)
        sys.stdout.flush()  # here, so a reader gone away (`| head`) is caught below, not at exit
        return status
    except BrokenPipeError:  # the reader of our output stopped reading: stop quietly, as Python's docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error flushing at exit
        return 1
    except UsageError as err:  # a flag, setting or file the command cannot use: what is wrong, exit 2
        print(f"error: {err}", file=sys.stderr)
        return 2
    # a locked or read-only store, a model folder without a tokenizer or chat template: one line, the cause
    except (StoreUnavailable, ModelFolderError) as err:
        print(f"lightning-dagster: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
