"""The first parent's warm start on short replies: SFT with 32 rows a step against the rows `batch_rows` picks,
side by side from the same base model, demonstrations and seed, on the starter project (`lightning-dagster
init`) and the calc example.

    .venv/bin/python benchmarks/warm_start_rows.py [--steps 300] [--every 25] [--seed 0]

For each project and each rows-per-step it prints, every `--every` SFT steps, the step's token-mean NLL and
the teacher-forced estimate the warm start uses to decide when to start probing (`demo_probability`: the mean
probability of a held-out demonstration's assistant tokens; probes start at 0.05), then the first step at
which that estimate reached 0.05 and 0.3 and the CPU seconds per step. No probe or gateway runs: this measures
the SFT alone, with the trainer's own thread setting (one per core): run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from lightning_dagster.engine.build import build_base_model, default_corpus
from lightning_dagster.engine.chat import ChatCodec
from lightning_dagster.project import load_project
from lightning_dagster.project.examples import example_file
from lightning_dagster.project.scaffold import write_starter
from lightning_dagster.settings import ServingSettings, TrainingSettings
from lightning_dagster.training import warmstart
from lightning_dagster.training.configs import warm_start_config
from lightning_dagster.training.trainer import Trainer, TrainerConfig


def run(
    base: Path, project: Path, rows_per_step: int | None, steps: int, every: int, seed: int
) -> dict | None:
    """SFT as the warm start does it (same rows, order and learning rate), with `rows_per_step` rows a step
    (None: `batch_rows`'s choice; nothing runs, None, when that is 32 too)."""
    config = warm_start_config(project, TrainingSettings(seed=seed), ServingSettings())
    demos = warmstart.load_demos(load_project(project).model.warm_start, project)
    train, held = warmstart.split_demos(demos, seed)
    rows, held_batch = warmstart.render_demos(ChatCodec(base), train, held, config)
    per_step = rows_per_step or warmstart.batch_rows(rows, config)
    if rows_per_step is None and per_step == 32:
        return None
    trainer = Trainer(base, TrainerConfig(lr=config.lr, device="cpu", loss=None))
    rng, curve, reached = random.Random(seed), [], {}
    started = time.perf_counter()
    for step in range(1, steps + 1):
        m = trainer.supervised_step(rng.sample(rows, per_step))
        if step % every == 0 or step == steps:
            p = warmstart.demo_probability(trainer.model, held_batch)
            curve.append((step, m["nll"], p))
            for bar in (0.05, 0.3):
                if p >= bar and bar not in reached:
                    reached[bar] = step
    seconds = time.perf_counter() - started  # with the estimates, one per `every` steps
    mean_tokens = sum(r.trained_tokens for r in rows) / len(rows)
    return {"rows_per_step": per_step, "mean_trained_tokens": round(mean_tokens, 1), "curve": curve,
            "reached": reached, "s_per_step": seconds / steps}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ld-warm-rows-") as work:
        base = build_base_model(Path(work) / "base", corpus=default_corpus(), seed=args.seed)
        write_starter(Path(work) / "starter")
        projects = {
            "starter": Path(work) / "starter" / "lightning-dagster.yaml",
            "calc": example_file("calc"),
        }
        for name, project in projects.items():
            for rows_per_step in (32, None):
                r = run(base, project, rows_per_step, args.steps, args.every, args.seed)
                if r is None:
                    print(f"  {name}: batch_rows keeps 32 rows a step (the run above)")
                    continue
                label = (
                    f"{name}, {r['rows_per_step']} rows/step ({r['mean_trained_tokens']} trained tokens/row)"
                )
                print(f"\n{label}: {r['s_per_step']:.2f} s/step; estimate >= 0.05 at step "
                      f"{r['reached'].get(0.05, '-')}, >= 0.3 at step {r['reached'].get(0.3, '-')}")  # fmt: skip
                print("  step    nll  estimate")
                for step, nll, p in r["curve"]:
                    print(f"  {step:4d}  {nll:.3f}  {p:.3f}")


if __name__ == "__main__":
    main()
