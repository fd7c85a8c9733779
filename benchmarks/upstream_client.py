"""The upstream backend's HTTP client: the hand-written keep-alive HTTP/1.1 client vs `httpx.AsyncClient`,
side by side, driving `UpstreamBackend.chat` against the stub upstream at the same concurrency.

Prints calls/s and client CPU per call (this process's user+system time; the stub runs in its own process)
for both, and their ratio. The two clients take turns in short rounds so the shared machine's drifting load
hits both alike.

    .venv/bin/python benchmarks/upstream_client.py [--concurrency 8] [--rounds 4] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_dagster.gateway.backends import CallSampling  # noqa: E402
from lightning_dagster.gateway.http1 import Http1Client  # noqa: E402
from lightning_dagster.gateway.upstreams import HttpxClient, UpstreamBackend  # noqa: E402

PROMPT = "x" * 180  # with the stub's role markup: ~200 prompt ids; replies are 50 ids with logprobs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pinned(UpstreamBackend):
    """The upstream backend with a chosen HTTP client."""

    def __init__(self, base_url: str, client) -> None:
        super().__init__(base_url, model="stub")
        self.pinned = client

    def _http(self, server):
        return self.pinned


def clients(url: str) -> dict:
    return {
        "http1": lambda: Http1Client(url, {}, timeout=30),
        "httpx": lambda: HttpxClient(url, {}, timeout=30),
    }


async def drive(backend: UpstreamBackend, concurrency: int, seconds: float) -> tuple[int, float, float]:
    """Calls made, wall seconds and CPU seconds of `concurrency` workers calling for `seconds`."""
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "stub", "messages": messages, "max_tokens": 50}
    sampling = CallSampling(max_tokens=50)
    stop = time.perf_counter() + seconds
    calls = 0

    async def worker() -> None:
        nonlocal calls
        while time.perf_counter() < stop:
            c = await backend.chat(messages, None, None, sampling, None, body)
            assert len(c.response_ids) == 50 and len(c.logprobs) == 50
            calls += 1

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return calls, time.perf_counter() - t0, time.process_time() - cpu0


async def bench(url: str, concurrency: int, rounds: int, seconds: float) -> dict:
    factories = clients(url)
    backends = {name: Pinned(url, make()) for name, make in factories.items()}
    totals = {name: [0, 0.0, 0.0] for name in backends}
    for backend in backends.values():  # warm up: connections opened, code paths imported
        await drive(backend, concurrency, 0.5)
    for r in range(rounds):
        order = list(backends) if r % 2 == 0 else list(reversed(backends))
        for name in order:
            calls, wall, cpu = await drive(backends[name], concurrency, seconds)
            totals[name][0] += calls
            totals[name][1] += wall
            totals[name][2] += cpu
    for backend in backends.values():
        await backend.pinned.aclose()
    out = {
        name: {"calls": calls, "calls_per_s": calls / wall, "cpu_ms_per_call": cpu / calls * 1e3}
        for name, (calls, wall, cpu) in totals.items()
    }
    out["httpx/http1"] = {
        "calls_per_s": out["httpx"]["calls_per_s"] / out["http1"]["calls_per_s"],
        "cpu_ms_per_call": out["httpx"]["cpu_ms_per_call"] / out["http1"]["cpu_ms_per_call"],
    }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stub_upstream", "--port", str(port), "--reply-tokens", "50"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/models").raise_for_status()
                break
            except httpx.HTTPError:
                if stub.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the stub upstream did not start") from None
                time.sleep(0.1)
        # uvloop, as the gateway's uvicorn runs
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            res = runner.run(bench(url, args.concurrency, args.rounds, args.seconds))
    finally:
        stub.terminate()
        stub.wait(timeout=10)
    print(json.dumps({"concurrency": args.concurrency, **res}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
