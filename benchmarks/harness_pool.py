"""In-process harnesses' HTTP connections: one pool shared by every worker thread against a client per thread
stripe, side by side, with the runner's concurrency.

The runner runs `python:` harnesses (and the built-in calc and ledger agents) on its worker threads, 64 by
default, each episode with an `openai.OpenAI` client over a process-wide `httpx.Client`. httpcore assigns
every request to a connection by walking the pool's connections and queued requests under one lock, and asks
each idle connection's socket whether it has expired (a `poll` call): with 64 calls in flight on 64
connections, each request start and each response end costs a walk over all of them. This script sends chat
calls from `--threads` threads through the real `openai` client to a stub server (its own process; each reply
waits `--latency-ms`, as a batch engine's does, so the calls overlap), once with the shared pool
(`shared`) and once with the pools striped by thread (`striped`, `project.harness.http_client` today),
alternating rounds, and prints this process's CPU per call (the stub's work is excluded) and the ratio.

    .venv/bin/python benchmarks/harness_pool.py [--threads 64] [--calls 3000] [--rounds 4] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_dagster.project.harness import http_client  # noqa: E402

REPLY = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 0,
    "model": "policy",
    "choices": [
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": "The answer is 42."},
        }
    ],
    "usage": {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48},
}

STUB = """
import asyncio, sys
body = sys.argv[2].encode()
head = b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\ncontent-length: %d\\r\\n\\r\\n" % len(body)
delay = float(sys.argv[3])

async def serve(reader, writer):
    try:
        while True:
            headers = await reader.readuntil(b"\\r\\n\\r\\n")
            length = 0
            for line in headers.split(b"\\r\\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            await asyncio.sleep(delay)
            writer.write(head + body)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()

async def main():
    server = await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1]), backlog=512)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_pool() -> httpx.Client:
    """What the harnesses used before: one pool for the process (256 connections, all kept alive)."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    return httpx.Client(limits=limits, timeout=60.0)


def drive(base_url: str, threads: int, calls: int, pool) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) for `calls` chat calls from `threads` threads, each call
    with a fresh `OpenAI` client over `pool()` (as the runner gives each episode)."""
    left = [calls]
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            client = OpenAI(base_url=base_url, api_key="k", max_retries=1, timeout=60.0, http_client=pool())
            reply = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "What is 6 * 7?"}], max_tokens=16
            )
            assert reply.choices[0].message.content

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    cpu, t0 = time.process_time(), time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - t0, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB, str(port), json.dumps(REPLY), str(args.latency_ms / 1000)]
    )
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the stub server did not start"
                time.sleep(0.1)
        shared = shared_pool()
        pools = {"shared": lambda: shared, "striped": http_client}
        for pool in pools.values():  # warm: connections opened, imports done
            drive(base_url, args.threads, args.threads * 2, pool)
        cpu: dict[str, list[float]] = {name: [] for name in pools}
        rate: dict[str, list[float]] = {name: [] for name in pools}
        for r in range(args.rounds):
            for name in list(pools) if r % 2 == 0 else list(pools)[::-1]:
                wall, used = drive(base_url, args.threads, args.calls, pools[name])
                cpu[name].append(used / args.calls * 1e3)
                rate[name].append(args.calls / wall)
                print(
                    f"round {r} {name:8s} {args.calls / wall:7.1f} calls/s  client CPU {used / args.calls * 1e3:.3f} ms/call",
                    flush=True,
                )
        med = {name: statistics.median(v) for name, v in cpu.items()}
        print(
            f"median client CPU ms/call: shared {med['shared']:.3f}  striped {med['striped']:.3f}  "
            f"striped/shared {med['striped'] / med['shared']:.3f}; calls/s shared "
            f"{statistics.median(rate['shared']):.0f}  striped {statistics.median(rate['striped']):.0f} "
            f"({args.threads} threads, {args.latency_ms:g} ms a reply)"
        )
    finally:
        stub.terminate()
        stub.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
