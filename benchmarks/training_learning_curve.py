"""The learning curve of `calc` RL through the real runner and gateway: held-out success sampled at T=1.0
(300 fixed tasks, one evaluation seed for every point) against RL seconds and steps, from a warm-started
parent. RL seconds count rollouts + trainer + weight push, not evaluation.

Run: .venv/bin/python benchmarks/training_learning_curve.py [--parent DIR] [--steps 60] [--eval-every 10]
(the training settings' flags, as `train` has them)
(without --parent it builds the base model and warm-starts a parent first, and reports that too).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_dagster.engine.build import build_base_model
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project.examples import example_file, example_harness, example_tasks
from lightning_dagster.runner.service import RolloutService
from lightning_dagster.settings import ServingSettings, TrainingSettings, add_flags, from_flags
from lightning_dagster.store import Store
from lightning_dagster.training.cli import sampling_service
from lightning_dagster.training.configs import warm_start_config
from lightning_dagster.training.loop import draw_pools, train_rl
from lightning_dagster.training.warmstart import warm_start

# The curve's recipe (benchmarks/README.md) where it differs from the settings' defaults.
CURVE = TrainingSettings(steps=60, tasks_per_step=16, holdout_tasks=300, eval_seed=20261130)
FLAGS = ["steps", "eval_every", "tasks_per_step", "group_size", "learning_rate", "holdout_tasks", "seed"]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=Path)
    parser.add_argument("--out", type=Path, help="write the curve and step metrics as JSON here")
    add_flags(parser, TrainingSettings, FLAGS)
    args = parser.parse_args()
    t = from_flags(CURVE, args)
    torch.set_num_threads(2)
    work = Path(tempfile.mkdtemp(prefix="ld-curve-"))
    store = Store(f"sqlite:///{work / 'store.db'}")
    parent = args.parent
    if parent is None:
        started = time.perf_counter()
        ws = warm_start(
            store,
            build_base_model(work / "base", corpus=training_corpus(seed=t.seed), seed=t.seed),
            work / "warm",
            warm_start_config(example_file("calc"), t, ServingSettings()),
        )
        parent = ws.model_dir
        print(
            f"warm start: {ws.steps} SFT steps, probe success {ws.probe_success:.3f}, "
            f"{time.perf_counter() - started:.0f} s"
        )

    def log(entry: dict) -> None:
        if "eval_seconds" in entry:  # an evaluation point (a step's metrics carry its batch's success too)
            print(f"step {entry['step']:3d}  rl {entry['rl_seconds']:6.1f} s  sampled {entry['success']:.3f}"
                  + (f"  greedy {entry['greedy']:.3f}" if "greedy" in entry else "")
                  + f"  (eval {entry['eval_seconds']:.0f} s)", flush=True)  # fmt: skip
        else:
            print(f"  step {entry['step']:3d} reward {entry['success']:.3f} skipped groups "
                  f"{entry['skipped_groups']}/{entry['groups']} rollouts {entry['rollout_seconds']:.1f} s "
                  f"train {entry['seconds']:.1f} s", flush=True)  # fmt: skip

    def serve() -> RolloutService:  # as `train` serves
        return sampling_service(store, parent, None, example_harness("calc"), t, ServingSettings())

    result = train_rl(parent, t, draw_pools(example_tasks("calc"), t), serve, base_seed=t.seed, log=log)
    base = result.parent["success"]
    print(f"{'step':>5} {'rl_seconds':>10} {'sampled':>8} {'delta':>7}")
    for p in result.curve:
        print(f"{p['step']:>5} {p['rl_seconds']:>10.1f} {p['success']:>8.3f} {p['success'] - base:>+7.3f}")
    within = [p for p in result.curve if p["rl_seconds"] <= 300]
    best = max(p["success"] for p in within) - base
    print(f"parent greedy {result.parent['greedy']:.3f} -> candidate greedy {result.candidate['greedy']:.3f}")
    print(f"best gain within 300 s of RL: {best:+.3f}; total {result.seconds:.0f} s")
    if args.out:
        args.out.write_text(json.dumps({"curve": result.curve, "steps": result.steps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
