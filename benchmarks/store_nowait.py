"""Does the gateway need `Store.try_add_spans`? Gateway-like span writes from an asyncio event loop on a
SQLite file store while another thread contends for the write lock (runner claims), side by side:

- `nowait`: what the gateway does with the non-blocking path: `try_add_spans([span], sync=False)` on the
  event loop when the span writer is idle, else (refused) the span writer thread's `add_spans`;
- `writer`: plain `add_spans` only, always through the span writer thread (`gateway.recorder.SpanWriter`).

Each of `--agents` coroutines loops: a simulated model call (`--call-ms`), then one ~1k-token LLM span
written and awaited (`wait=True, sync=False`, the gateway's default). A ticker coroutine measures the
event loop's stall (how late a 1 ms sleep wakes). A runner thread with its own Store claims rollouts and
ends their attempts (each a synced `BEGIN IMMEDIATE` transaction), pausing `--claim-pause-ms` between.

    .venv/bin/python benchmarks/store_nowait.py [--seconds 2] [--agents 8] [--call-ms 2] [--claim-pause-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from lightning_dagster.gateway.recorder import SpanWriter
from lightning_dagster.store import Store
from lightning_dagster.types import AttemptState, Rollout, Span, SpanKind


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def claim_loop(
    url: str, pause_s: float, ready: threading.Event, stop: threading.Event, counts: dict[str, int]
) -> None:
    """Runner-like write-lock contention: claim a rollout, end its attempt (each a synced commit), pause."""
    with Store(url) as store:
        store.enqueue_rollouts([Rollout() for _ in range(5_000)])
        ready.set()
        while not stop.wait(pause_s):
            claimed = store.claim_rollout("runner")
            if claimed is None:
                return
            store.transition_attempt(claimed[1].attempt_id, AttemptState.succeeded)
            counts["claims"] += 1


async def run_mode(
    url: str, mode: str, seconds: float, agents: int, call_s: float, pause_s: float
) -> dict[str, float]:
    store = Store(url)
    writer = SpanWriter(store)
    rng = random.Random(0)
    attempts = []
    for _ in range(agents):
        (rollout,) = store.enqueue_rollouts([Rollout()])
        _, attempt = store.claim_rollout("gateway")
        attempts.append((rollout.rollout_id, attempt.attempt_id))
    latencies: list[float] = []
    stalls: list[float] = []
    inline = 0
    deadline = 0.0  # set once the runner is claiming

    async def record(span: Span) -> None:
        nonlocal inline
        if mode == "nowait" and writer.idle and store.try_add_spans([span], sync=False):
            inline += 1
            return
        await writer.write([span], wait=True, sync=False)

    async def agent(rollout_id: str, attempt_id: str) -> None:
        prompt = [rng.randrange(150_000) for _ in range(1000)]
        sequence = 0
        while time.perf_counter() < deadline:
            await asyncio.sleep(call_s)
            response = [rng.randrange(150_000) for _ in range(40)]
            span = Span(
                rollout_id=rollout_id,
                attempt_id=attempt_id,
                trace_id=attempt_id,
                sequence=sequence,
                name="chat.completions",
                kind=SpanKind.llm,
                prompt_token_ids=prompt,
                response_token_ids=response,
                response_logprobs=[-0.5] * len(response),
            )
            t0 = time.perf_counter()
            await record(span)
            latencies.append(time.perf_counter() - t0)
            sequence += 1
            prompt = prompt + response + [7] * 15

    async def ticker() -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - t0 - 0.001)

    # the first span of each attempt goes through the blocking path (the attempt is looked up once)
    for rid, aid in attempts:
        store.add_spans(
            [Span(rollout_id=rid, attempt_id=aid, sequence=-1, name="start", kind=SpanKind.tool)], sync=False
        )
    ready, stop, counts = threading.Event(), threading.Event(), {"claims": 0}
    runner = threading.Thread(target=claim_loop, args=(url, pause_s, ready, stop, counts))
    runner.start()
    ready.wait()
    t_start = time.perf_counter()
    deadline = t_start + seconds
    await asyncio.gather(ticker(), *(agent(r, a) for r, a in attempts))
    elapsed = time.perf_counter() - t_start
    stop.set()
    runner.join()
    writer.close()
    written = sum(store.count_spans(attempt_id=a) - 1 for _, a in attempts)
    store.close()
    assert written == len(latencies), (written, len(latencies))
    return {
        "spans/s": len(latencies) / elapsed,
        "write p50 ms": 1000 * statistics.median(latencies),
        "write p99 ms": 1000 * percentile(latencies, 0.99),
        "stall p50 ms": 1000 * statistics.median(stalls),
        "stall p99 ms": 1000 * percentile(stalls, 0.99),
        "stall max ms": 1000 * max(stalls),
        "inline %": 100 * inline / max(1, len(latencies)),
        "claims/s": counts["claims"] / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--call-ms", type=float, default=2.0)
    parser.add_argument("--claim-pause-ms", type=float, default=5.0, help="0: the runner claims back to back")
    args = parser.parse_args()
    results, pause_s = {}, args.claim_pause_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("nowait", "writer"):
            url = f"sqlite:///{Path(tmp) / f'{mode}.db'}"
            results[mode] = asyncio.run(
                run_mode(url, mode, args.seconds, args.agents, args.call_ms / 1000, pause_s)
            )
    keys = list(results["nowait"])
    print(
        f"agents={args.agents} call={args.call_ms:g}ms claim pause={args.claim_pause_ms:g}ms seconds={args.seconds:g}"
    )
    print(f"{'':14}" + "".join(f"{k:>14}" for k in keys))
    for mode, row in results.items():
        print(f"{mode:14}" + "".join(f"{row[k]:14.2f}" for k in keys))
    ratio = {k: results["nowait"][k] / results["writer"][k] if results["writer"][k] else 0.0 for k in keys}
    print(f"{'nowait/writer':14}" + "".join(f"{ratio[k]:14.2f}" for k in keys))


if __name__ == "__main__":
    main()
