"""Embedded engine throughput, measured side by side in one run.

Generated tokens/s at batch 1, 16 and 64; 64 concurrent submitters through BatchingEngine against the same
64 requests served one at a time; the thin sampling loop against transformers' `generate` (top_k=0);
3-turn tool episodes with and without the prefix cache; one torch thread against two. Prompts are real
rendered calc prompts (system, tools, user question).

    .venv/bin/python benchmarks/engine_throughput.py [--model DIR] [--tokens 48]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from lightning_dagster.engine import BatchingEngine, Engine, SamplingParams, build_base_model
from lightning_dagster.engine.build import CALCULATOR_TOOL
from lightning_dagster.harnesses.corpus import training_corpus


def _prompts(engine: Engine, n: int) -> list[list[int]]:
    """n distinct calc prompts of one token length, so no row pays for padding."""
    system = {"role": "system", "content": "Use the calculator tool, then reply ANSWER: <number>."}
    pool = [
        engine.render([system, {"role": "user", "content": f"Ann has {a} pens and buys {b} more."}], [CALCULATOR_TOOL])
        for a in range(10, 60) for b in range(3, 13)
    ]  # fmt: skip
    length = Counter(len(p) for p in pool).most_common(1)[0][0]
    return [p for p in pool if len(p) == length][:n]


Rate = tuple[float, float]  # (generated tokens per wall second, per CPU second of this process)


def _measure(run: Callable[[], int]) -> Rate:
    wall, cpu = time.perf_counter(), time.process_time()
    n = run()
    return n / (time.perf_counter() - wall), n / (time.process_time() - cpu)


def _rate(run: Callable[[], int], repeats: int = 2) -> Rate:
    """Best of `repeats`. The machine is shared, so CPU seconds are the fairer figure; both are printed."""
    return max(_measure(run) for _ in range(repeats))


def _compare(label: str, a_name: str, run_a, b_name: str, run_b, repeats: int = 2) -> None:
    """A and B measured alternately (A, B, A, B, ...), best of each, so load swings hit both alike."""
    a, b = (0.0, 0.0), (0.0, 0.0)
    for _ in range(repeats):
        a, b = max(a, _measure(run_a)), max(b, _measure(run_b))
    print(
        f"{label}: {a_name} {a[0]:.0f} tok/s ({a[1]:.0f}/CPU-s) vs {b_name} {b[0]:.0f} tok/s ({b[1]:.0f}/CPU-s)"
        f" -> {a[0] / b[0]:.2f}x wall, {a[1] / b[1]:.2f}x CPU"
    )


def _generate(engine: Engine, prompts: list[list[int]], tokens: int) -> Callable[[], int]:
    params = SamplingParams(max_tokens=tokens, seed=0)
    return lambda: sum(len(g.token_ids) for g in engine.generate(prompts, params))


def _hf_generate(engine: Engine, prompts: list[list[int]], tokens: int) -> Callable[[], int]:
    batch = engine.tokenizer.pad({"input_ids": prompts}, return_tensors="pt")  # left padding

    def run() -> int:
        with torch.inference_mode():
            out = engine.model.generate(
                **batch, do_sample=True, top_k=0, max_new_tokens=tokens, min_new_tokens=tokens,
                pad_token_id=engine.pad_token_id, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
        return (out.sequences.shape[1] - batch["input_ids"].shape[1]) * len(prompts)

    return run


def _with_threads(threads: int, run: Callable[[], int]) -> Callable[[], int]:
    def wrapped() -> int:
        torch.set_num_threads(threads)
        try:
            return run()
        finally:
            torch.set_num_threads(1)

    return wrapped


def _batching(engine: Engine, prompts: list[list[int]], tokens: int, batches: list[int]) -> Callable[[], int]:
    """64 client threads released together, each submitting one seeded request."""
    params = [SamplingParams(max_tokens=tokens, seed=i) for i in range(len(prompts))]

    def run() -> int:
        results: list = [None] * len(prompts)
        with BatchingEngine(engine, max_batch=64, max_wait_ms=5) as batching:
            barrier = threading.Barrier(len(prompts))

            def client(i: int) -> None:
                barrier.wait()
                results[i] = batching.submit(prompts[i], params[i]).result()

            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            batches.append(batching.batches_run)
        return sum(len(g.token_ids) for g in results)

    return run


def _sequential(engine: Engine, prompts: list[list[int]], tokens: int) -> Callable[[], int]:
    params = [SamplingParams(max_tokens=tokens, seed=i) for i in range(len(prompts))]
    return lambda: sum(
        len(engine.generate([p], s)[0].token_ids) for p, s in zip(prompts, params, strict=True)
    )


def _episodes(engine: Engine, prompts: list[list[int]], tokens: int, turns: int = 3) -> Callable[[], int]:
    """Tool episodes as the gateway drives them: each turn's prompt is the exact previous prompt + response
    + a tool result turn + a new assistant header; all rows advance together."""
    tool_turn = engine.encode("\n") + engine.render([{"role": "tool", "content": "19"}])
    params = [SamplingParams(max_tokens=tokens, seed=i) for i in range(len(prompts))]

    def run() -> int:
        current, total = [list(p) for p in prompts], 0
        for _ in range(turns):
            gens = engine.generate(current, params)
            total += sum(len(g.token_ids) for g in gens)
            current = [p + g.token_ids + tool_turn for p, g in zip(current, gens, strict=True)]
        return total

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=None, help="model dir (default: build the base model)")
    ap.add_argument("--tokens", type=int, default=48, help="generated tokens per request")
    args = ap.parse_args()
    model = args.model or build_base_model(
        Path(tempfile.mkdtemp()) / "model", corpus=training_corpus(), seed=0
    )
    engine = Engine(model, threads=1)
    cold = Engine(model, threads=1, prefix_cache_mb=0)
    prompts = _prompts(engine, 64)
    print(f"model {model}  prompt tokens {len(prompts[0])}  generated per request {args.tokens}  "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")  # fmt: skip
    engine.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm up

    rates = {b: _rate(_generate(engine, prompts[:b], args.tokens)) for b in (1, 16, 64)}
    for b, (wall, cpu) in rates.items():
        print(
            f"batch {b:>2}: {wall:6.0f} generated tok/s ({cpu:6.0f}/CPU-s)   "
            f"{wall / rates[1][0]:5.1f}x batch 1 wall, {cpu / rates[1][1]:5.1f}x CPU"
        )
    p16 = prompts[:16]
    _compare(
        "batch 16", "thin loop", _generate(engine, p16, args.tokens),
        "HF generate(top_k=0)", _hf_generate(engine, p16, args.tokens),
    )  # fmt: skip
    batches: list[int] = []
    _compare(
        "64 requests", "BatchingEngine, 64 submitters", _batching(engine, prompts, args.tokens, batches),
        "sequential generate", _sequential(engine, prompts, args.tokens), repeats=1,
    )  # fmt: skip
    print(f"  (BatchingEngine served the 64 requests in {batches} batch(es))")
    _compare(
        "64 x 3-turn episodes", "prefix cache", _episodes(engine, prompts, args.tokens // 2),
        "re-prefill", _episodes(cold, prompts, args.tokens // 2),
    )  # fmt: skip
    groups = [prompts[i // 16] for i in range(64)]  # 4 tasks x 16 samples, as GRPO sends them
    _compare(
        "64 rows", "4 groups of 16 identical prompts", _generate(engine, groups, args.tokens),
        "64 distinct prompts", _generate(engine, prompts, args.tokens),
    )  # fmt: skip
    _compare(
        "batch 16", "1 torch thread", _generate(engine, p16, args.tokens),
        "2 threads", _with_threads(2, _generate(engine, p16, args.tokens)),
    )  # fmt: skip


if __name__ == "__main__":
    main()
