"""The same RL run served by the embedded engine and by vLLM, side by side in one run: the calc agent, one
warm-started parent, the same tasks, settings and seeds; whole weights and a LoRA adapter. Reports per engine
and adapter: the RL step's wall time (sampling through the gateway and runner, the trainer's update and the
weight sync), rollouts per second of sampling, the engine/trainer logprob gap the trainer measured
(mean and max |dlogprob| per token), and the held-out lift (sampled at T=1.0, one evaluation seed) after
the steps.

Run: .venv/bin/python benchmarks/vllm_engine.py --parent DIR [--steps 6] [--tasks-per-step 8]
     [--holdout-tasks 128] [--runs embedded/full,vllm/full,vllm/lora,embedded/lora]
(a parent: e.g. a demo home's warm start, `<home>/models/calc-warm-start`; needs `make vllm`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from lightning_dagster.project.examples import example_harness, example_tasks
from lightning_dagster.settings import ServingSettings, TrainingSettings, add_flags, from_flags
from lightning_dagster.store import Store
from lightning_dagster.training.cli import sampling_service
from lightning_dagster.training.loop import draw_pools, train_rl

RECIPE = TrainingSettings(steps=6, tasks_per_step=8, group_size=16, holdout_tasks=128, validation_tasks=0,
                          eval_every=1000, lora_rank=16, lora_alpha=32.0)  # fmt: skip
FLAGS = ["steps", "tasks_per_step", "group_size", "learning_rate", "holdout_tasks", "seed", "lora_rank"]


def one_run(parent: Path, engine: str, adapter: str, t: TrainingSettings, work: Path) -> dict:
    t = t.updated({"adapter": adapter, "learning_rate": t.learning_rate * (10 if adapter == "lora" else 1)})
    serving = ServingSettings(engine=engine)
    store = Store(f"sqlite:///{work / f'{engine}-{adapter}.db'}")
    steps: list[dict] = []

    def log(entry: dict) -> None:
        if "eval_seconds" not in entry:
            steps.append(entry)
            print(f"  {engine}/{adapter} step {entry['step']}: reward {entry['success']:.3f}, "
                  f"rollouts {entry['rollout_seconds']:.1f} s, train {entry['seconds']:.1f} s", flush=True)  # fmt: skip

    def serve():
        return sampling_service(store, parent, None, example_harness("calc"), t, serving)

    result = train_rl(parent, t, draw_pools(example_tasks("calc"), t), serve, base_seed=t.seed, log=log)
    rollouts_per_step = t.tasks_per_step * t.group_size
    timed = steps[1:] or steps  # the first step also starts the engine's caches
    return {
        "run": f"{engine}/{adapter}",
        "step_s": statistics.median(s["rollout_seconds"] + s["seconds"] for s in timed),
        "rollouts_per_s": statistics.median(rollouts_per_step / s["rollout_seconds"] for s in timed),
        "gap_mean": statistics.mean(s.get("abs_log_ratio_mean", 0.0) for s in steps),
        "gap_max": max(s.get("abs_log_ratio_max", 0.0) for s in steps),
        "parent": result.parent["success"],
        "candidate": result.candidate["success"],
        "total_s": result.seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=Path, required=True)
    parser.add_argument("--runs", default="embedded/full,vllm/full,vllm/lora,embedded/lora")
    add_flags(parser, TrainingSettings, FLAGS)
    args = parser.parse_args()
    t = from_flags(RECIPE, args)
    work = Path(tempfile.mkdtemp(prefix="ld-vllm-bench-"))
    rows = [one_run(args.parent, *run.split("/"), t, work) for run in args.runs.split(",")]
    print(f"\n{t.steps} steps of {t.tasks_per_step} tasks x group {t.group_size}, {t.holdout_tasks} held-out "
          f"tasks, parent {args.parent}")  # fmt: skip
    print(
        f"{'run':>14} {'step s':>7} {'rollouts/s':>10} {'gap mean':>9} {'gap max':>8} {'held-out':>15} {'lift':>7}"
    )
    for r in rows:
        print(f"{r['run']:>14} {r['step_s']:>7.1f} {r['rollouts_per_s']:>10.1f} {r['gap_mean']:>9.1e} "
              f"{r['gap_max']:>8.1e} {r['parent']:>7.3f}->{r['candidate']:.3f} "
              f"{r['candidate'] - r['parent']:>+7.3f}")  # fmt: skip
    base = next((r for r in rows if r["run"] == "embedded/full"), None)
    if base is not None:
        for r in rows:
            print(f"{r['run']}: step time {r['step_s'] / base['step_s']:.2f}x embedded/full's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
