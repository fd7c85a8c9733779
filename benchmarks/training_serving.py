"""Where the gateway + engine run during RL: in the trainer's process (`thread`) or in a child process
(`process`: `RolloutService(child=True)`), both with the engine inside the gateway, side by side in one run on the same parent, tasks and seeds.

Each round: one step's rollouts (tasks x group through the real runner + gateway), one trainer step, one
weight push; modes alternate round by round so load drifts hit both. Prints seconds per phase and the ratio.

Run: .venv/bin/python benchmarks/training_serving.py --parent DIR [--rounds 2] [--tasks 16] [--group 16]
(without --parent it builds the base model and warm-starts a parent first).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from lightning_dagster.engine.build import build_base_model
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project.examples import example_file, example_tasks
from lightning_dagster.runner.service import RolloutService
from lightning_dagster.settings import ServingSettings, TrainingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.advantages import compute_advantages
from lightning_dagster.training.configs import step_settings, trainer_config, warm_start_config
from lightning_dagster.training.step import rows_and_rewards
from lightning_dagster.training.trainer import Trainer
from lightning_dagster.training.warmstart import warm_start
from lightning_dagster.types import RolloutKind, Sampling

MODES = ("thread", "process")


def one_round(store: Store, parent: Path, mode: str, tasks: list[dict], group: int, seed: int) -> dict:
    trainer = Trainer(parent, trainer_config(TrainingSettings()))
    serving = ServingSettings(parallel=64, engine_process=False)
    with RolloutService(store, parent, harness="calc", serving=serving, child=mode == "process") as svc:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = svc.run(
            tasks,
            group=group,
            kind=RolloutKind.train,
            sampling=Sampling(temperature=1.0),
            seed=seed,
            tag=mode,
        )
        t1 = time.perf_counter()
        rows, rewards, _ = rows_and_rewards(batch, step_settings(TrainingSettings()))
        trainer.step(rows, compute_advantages(rewards, "grpo"))
        t2 = time.perf_counter()
        svc.load_weights(trainer.state_dict(), f"{mode}-pushed")
        t3 = time.perf_counter()
    return {
        "rollouts": t1 - t0,
        "train": t2 - t1,
        "push": t3 - t2,
        "step": t3 - t0,
        "parent_cpu": time.process_time() - c0,
        "success": batch.success(),
        "n": len(batch.rollouts),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=Path)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ld-serving-"))
    store = Store(f"sqlite:///{work / 'store.db'}")
    parent = (
        args.parent
        or warm_start(
            store,
            build_base_model(work / "base", corpus=training_corpus(seed=0), seed=0),
            work / "warm",
            warm_start_config(example_file("calc"), TrainingSettings(), ServingSettings()),
        ).model_dir
    )
    tasks = example_tasks("calc").draw("train", args.tasks * args.rounds, 0)
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    print(f"load average {os.getloadavg()[0]:.1f}, {args.tasks} tasks x group {args.group} per step")
    for r in range(args.rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            res = one_round(store, parent, mode, tasks[r * args.tasks : (r + 1) * args.tasks], args.group, r)
            results[mode].append(res)
            print(
                f"round {r} {mode:>7}: rollouts {res['rollouts']:5.2f} s ({res['n'] / res['rollouts']:5.1f}/s)"
                f"  train {res['train']:4.2f} s  push {res['push']:4.2f} s  step {res['step']:5.2f} s"
                f"  trainer-process CPU {res['parent_cpu']:5.2f} s  success {res['success']:.3f}",
                flush=True,
            )
    med = {
        m: {k: statistics.median(x[k] for x in results[m]) for k in ("rollouts", "train", "step")}
        for m in MODES
    }
    for k in ("rollouts", "train", "step"):
        print(f"median {k:>8}: thread {med['thread'][k]:5.2f} s  process {med['process'][k]:5.2f} s  "
              f"thread/process {med['thread'][k] / med['process'][k]:.2f}x")  # fmt: skip
    same = all(
        a["success"] == b["success"] for a, b in zip(results["thread"], results["process"], strict=True)
    )
    print(f"same rollouts' success in both modes (common random numbers): {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
