"""Trainer throughput on this machine: one RL step (forward, backward, Adam) over 64 calc-shaped trajectories
of 3 turns, as merged rows and as one row per call, side by side.
Run: .venv/bin/python benchmarks/training_throughput.py [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # noqa: E402 - run as a script from anywhere
from benchmarks.training_merge import trace  # noqa: E402
from lightning_dagster.engine.build import build_base_model
from lightning_dagster.engine.engine import Engine
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.settings import TrainingSettings
from lightning_dagster.training.advantages import RolloutReward, compute_advantages
from lightning_dagster.training.configs import trainer_config
from lightning_dagster.training.trainer import Trainer
from lightning_dagster.training.transitions import TransitionConfig, merge_calls


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--trajectories", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        base = build_base_model(d, corpus=training_corpus())
        engine = Engine(base)
        spans = trace(engine, 3)
        rewards = [RolloutReward(f"r{i}", f"g{i // 8}", float(i % 3 == 0)) for i in range(args.trajectories)]
        adv = compute_advantages(rewards, "grpo")
        results = {}
        for mode in ("merged", "per_call"):
            rows = []
            for i in range(args.trajectories):
                r, _ = merge_calls(spans, TransitionConfig(mode=mode))
                rows += [replace(x, rollout_id=f"r{i}") for x in r]
            trainer = Trainer(base, trainer_config(TrainingSettings()))
            trainer.step(rows, adv)  # warm-up
            best, cpu = None, None
            for _ in range(args.repeat):
                t, c = time.perf_counter(), time.process_time()
                m = trainer.step(rows, adv)
                dt, dc = time.perf_counter() - t, time.process_time() - c
                best, cpu = (dt, dc) if best is None or dt < best else (best, cpu)
            tokens = sum(len(r) for r in rows)
            results[mode] = (tokens, best, tokens / best, m["trained_tokens"])
            print(
                f"{mode:>9}: {len(rows):4d} rows {tokens:7d} tokens  step {best:6.2f} s  {tokens / best:8.0f} tokens/s"
                f"  ({cpu:6.2f} CPU s, {tokens / cpu:6.0f} tokens per CPU second; load {os.getloadavg()[0]:.1f})"
            )
        merged, per_call = results["merged"], results["per_call"]
        print(f"per-call / merged: tokens {per_call[0] / merged[0]:.2f}x, step time {per_call[1] / merged[1]:.2f}x "
              f"(same {int(merged[3])} trained tokens)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
