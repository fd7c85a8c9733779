"""Static vs continuous batching in `BatchingEngine`, side by side in one run, under a calc-harness-like load.

`--workers` client threads (64) each run `--rollouts` tool episodes one after another; an episode is two
sequential calls, as the calc harness makes through the gateway: a rendered calc prompt (system + tools +
user, ~100 tokens), then that prompt + the response + a tool-result turn (token-in, so the prefix cache
applies), each sampling 10-48 tokens at T=1.0 (drawn per call). Between calls a worker waits a uniform
0-2x `--think-ms` (the harness and HTTP; random, so workers do not fall into lockstep), and it starts after
a random 0-20 ms offset. Every call is seeded, so both policies
sample exactly the same tokens and the comparison is over identical work (checked).

The policies alternate (static, continuous, static, ...) `--repeats` times so load swings on the shared
machine hit both; each run prints generated tokens per wall second and per CPU second of the process, the
mean running batch (rows per decode step), rows per admission, and p50/p95 call latency.

    .venv/bin/python benchmarks/engine_continuous.py [--model DIR] [--workers 64] [--rollouts 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_dagster.engine import BatchingEngine, Engine, SamplingParams, build_base_model
from lightning_dagster.engine.build import CALCULATOR_TOOL
from lightning_dagster.harnesses.corpus import training_corpus


@dataclass
class Run:
    policy: str
    tokens: int
    wall: float
    cpu: float
    mean_batch: float
    per_admission: float
    latencies: list[float]
    outputs: dict[tuple[int, int, int], list[int]]

    def line(self) -> str:
        lat = sorted(self.latencies)
        p50, p95 = lat[len(lat) // 2], lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        return (
            f"{self.policy:>10}  {self.tokens / self.wall:7.0f} tok/s  {self.tokens / self.cpu:7.0f} tok/CPU-s"
            f"  batch {self.mean_batch:5.1f}  rows/admission {self.per_admission:5.1f}"
            f"  latency p50 {1000 * p50:6.0f} ms  p95 {1000 * p95:6.0f} ms  ({len(lat)} calls, {self.wall:.1f} s)"
        )


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    system = {"role": "system", "content": "Use the calculator tool, then reply ANSWER: <number>."}
    rng = random.Random(0)
    return [
        engine.render(
            [system, {"role": "user", "content": f"Ann has {rng.randint(10, 999)} pens and buys {rng.randint(3, 99)} more. How many now?"}],
            [CALCULATOR_TOOL],
        )
        for _ in range(n)
    ]  # fmt: skip


def run_policy(engine: Engine, args: argparse.Namespace, *, continuous: bool) -> Run:
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()  # both policies start cold
    prompts = _prompts(engine, args.workers)
    tool_turn = engine.encode("\n") + engine.render([{"role": "tool", "content": "1042"}])
    latencies: list[float] = []
    outputs: dict[tuple[int, int, int], list[int]] = {}
    lock = threading.Lock()
    batching = BatchingEngine(
        engine, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms, continuous=continuous
    )

    def worker(w: int) -> None:
        rng = random.Random(w)
        time.sleep(rng.uniform(0, 0.02))
        for r in range(args.rollouts):
            prompt = prompts[(w + r) % len(prompts)]
            for call in range(2):
                params = SamplingParams(
                    temperature=1.0, max_tokens=rng.randint(10, 48), seed=(w * 1000 + r) * 10 + call
                )
                start = time.perf_counter()
                gen = batching.submit(prompt, params).result()
                took = time.perf_counter() - start
                with lock:
                    latencies.append(took)
                    outputs[(w, r, call)] = gen.token_ids
                prompt = prompt + gen.token_ids + tool_turn
                time.sleep(rng.uniform(0, 2 * args.think_ms) / 1000)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.workers)]
    wall, cpu = time.perf_counter(), time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    batching.close()
    return Run(
        "continuous" if continuous else "static",
        sum(len(t) for t in outputs.values()),
        wall,
        cpu,
        batching.rows_stepped / max(1, batching.steps_run),
        len(latencies) / max(1, batching.batches_run),
        latencies,
        outputs,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="HF model directory (default: build a tiny one)")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--rollouts", type=int, default=1, help="episodes (2 calls each) per worker")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--think-ms", type=float, default=3.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_base_model(Path(tmp) / "model", corpus=training_corpus(), seed=0)
        engine = Engine(model, threads=args.threads)
        print(
            f"model {model}; {args.workers} workers x {args.rollouts} episodes x 2 calls, max_batch {args.max_batch}"
        )
        run_policy(engine, argparse.Namespace(**{**vars(args), "workers": 8, "rollouts": 1}), continuous=True)
        runs: dict[str, list[Run]] = {"static": [], "continuous": []}
        for _ in range(args.repeats):
            for continuous in (False, True):
                run = run_policy(engine, args, continuous=continuous)
                runs[run.policy].append(run)
                print(run.line(), flush=True)
    same = all(r.outputs == runs["static"][0].outputs for rs in runs.values() for r in rs)
    print(f"identical tokens across every run and policy: {same}")
    best = {p: max(rs, key=lambda r: r.tokens / r.wall) for p, rs in runs.items()}
    print("best of each:")
    for run in best.values():
        print(run.line())
    s, c = best["static"], best["continuous"]
    p50 = {p: statistics.median(r.latencies) for p, r in best.items()}
    print(
        f"continuous / static: {(c.tokens / c.wall) / (s.tokens / s.wall):.2f}x wall tok/s, "
        f"{(c.tokens / c.cpu) / (s.tokens / s.cpu):.2f}x tok/CPU-s, p50 latency {p50['continuous'] / p50['static']:.2f}x"
    )


if __name__ == "__main__":
    main()
