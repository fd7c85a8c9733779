"""Our gateway (upstream mode) vs Agent Lightning 1.0.2's `agl-server`, side by side against one stub upstream
that returns vLLM-shaped JSON (200 prompt ids, 50 response ids with logprobs).

Measures, per proxied call: server CPU time (psutil, user+system of the server process), added latency over
a direct upstream call (p50/p99; each call follows a direct one, the gateways take turns in rounds of 10
calls), and retained bytes on 10-turn rollouts with
~1k-token prompts (server RSS growth; for ours plus the growth of the SQLite store after a WAL checkpoint).

    .venv/bin/python benchmarks/gateway_vs_agl.py [--calls 300] [--rollouts 40]

Agent Lightning runs from its own Python 3.12 venv (benchmarks/.work/agl-venv, created on first use with
`pip install agentlightning==1.0.2`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "benchmarks" / ".work"
AGL_VENV = WORK / "agl-venv"
PY = sys.executable
SECRET, ADMIN = "bench-secret-0123456789", "bench-admin-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def python312() -> str:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
        return found
    for candidate in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12"))):
        return candidate
    raise RuntimeError("python3.12 not found")


def ensure_agl() -> Path:
    exe = AGL_VENV / "bin" / "agl-server"
    if not exe.exists():
        subprocess.run([python312(), "-m", "venv", str(AGL_VENV)], check=True)
        subprocess.run([str(AGL_VENV / "bin" / "pip"), "install", "-q", "agentlightning==1.0.2"], check=True)
    return exe


class Server:
    def __init__(self, name: str, args: list[str], health: str, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen(
            args,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=WORK,
        )
        wait_http(health, self.proc)
        self.ps = psutil.Process(self.proc.pid)

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Ours:
    """Our gateway in upstream mode, its store, and one attempt key per rollout."""

    def __init__(self, upstream: str, db: Path, write_behind_ms: float = 0.0):
        sys.path.insert(0, str(ROOT))
        from lightning_dagster.store import Store

        self.db = db
        self.store = Store(f"sqlite:///{db}")
        self.port = free_port()
        cli = str(Path(PY).parent / "lightning-dagster")
        args = [
            cli,
            "gateway",
            "serve",
            "--upstream",
            upstream,
            "--port",
            str(self.port),
            "--store",
            self.store.url,
        ]
        # The gateway takes its secrets from 0600 files, never from its environment or command line.
        for option, value in (("--secret-file", SECRET), ("--admin-key-file", ADMIN)):
            path = Path(db).parent / option.strip("-")
            path.write_text(value)
            path.chmod(0o600)
            args += [option, str(path)]
        self.server = Server("ours", args, f"http://127.0.0.1:{self.port}/admin/health", {})

    def new_rollout(self) -> tuple[str, dict]:
        from lightning_dagster.gateway import attempt_key
        from lightning_dagster.types import Rollout

        (r,) = self.store.enqueue_rollouts([Rollout()])
        _, a = self.store.claim_rollout("bench", rollout_ids=[r.rollout_id])
        key = attempt_key(SECRET, r.rollout_id, a.attempt_id)
        return f"http://127.0.0.1:{self.port}/v1/chat/completions", {"Authorization": f"Bearer {key}"}

    def store_bytes(self) -> int:
        with sqlite3.connect(self.db) as c:
            c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return sum(
            Path(str(self.db) + s).stat().st_size for s in ("", "-wal") if Path(str(self.db) + s).exists()
        )


class Agl:
    def __init__(self, upstream: str):
        exe = ensure_agl()
        self.port = free_port()
        args = [
            str(exe),
            "host=127.0.0.1",
            f"port={self.port}",
            "key=",
            "default_proxy.model_name=stub",
            "hydra.run.dir=.",
        ]
        self.server = Server("agl", args, f"http://127.0.0.1:{self.port}/healthz")
        base = f"http://127.0.0.1:{self.port}"
        httpx.post(f"{base}/api/models", json=[{"model": "stub", "endpoint": upstream}]).raise_for_status()
        self.n = 0

    def new_rollout(self) -> tuple[str, dict]:
        self.n += 1
        rid = f"bench-{self.n}"
        base = f"http://127.0.0.1:{self.port}"
        httpx.post(f"{base}/api/rollouts", json=[{"input": {}, "rollout_id": rid}]).raise_for_status()
        return f"{base}/proxy/rollout/{rid}/attempt/0/mode/train/openai/v1/chat/completions", {}


def call(client: httpx.Client, url: str, headers: dict, messages: list[dict]) -> tuple[float, dict]:
    body = {
        "model": "stub",
        "messages": messages,
        "max_tokens": 50,
        "logprobs": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    r = client.post(url, json=body, headers=headers)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    data = r.json()
    assert len(data["choices"][0]["token_ids"]) == 50, data
    return dt, data


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def cpu_and_latency(targets: dict, direct_url: str, calls: int) -> dict:
    """Rounds of 10 calls per gateway, the gateways taking turns round after round (a new rollout each
    round), every call preceded by a direct stub call: the machine's load drifts (2 shared cores) and
    taking turns spreads the drift over all gateways alike. A server idles while the others are served,
    so its CPU time over the whole run is the CPU of its own calls."""
    msgs = [{"role": "user", "content": "x" * 183}]  # stub: 200 prompt ids
    out: dict = {}
    direct: dict = {k: [] for k in targets}
    lat: dict = {k: [] for k in targets}
    with httpx.Client(timeout=60) as client:
        for target in targets.values():
            route = target.new_rollout()
            for _ in range(20):  # warm-up: connections, imports, caches
                call(client, direct_url, {}, msgs)
                call(client, *route, msgs)
        cpu0 = {k: t.server.cpu() for k, t in targets.items()}
        for _ in range(0, calls, 10):
            for k, target in targets.items():
                route = target.new_rollout()
                for _ in range(10):
                    direct[k].append(call(client, direct_url, {}, msgs)[0])
                    lat[k].append(call(client, *route, msgs)[0])
        for k, target in targets.items():
            n = len(lat[k])
            out[k] = {
                "cpu_ms_per_call": (target.server.cpu() - cpu0[k]) / n * 1e3,
                "direct_p50_ms": pct(direct[k], 0.5) * 1e3,
                "direct_p99_ms": pct(direct[k], 0.99) * 1e3,
                "p50_ms": pct(lat[k], 0.5) * 1e3,
                "p99_ms": pct(lat[k], 0.99) * 1e3,
                "added_p50_ms": (pct(lat[k], 0.5) - pct(direct[k], 0.5)) * 1e3,
                "added_p99_ms": (pct(lat[k], 0.99) - pct(direct[k], 0.99)) * 1e3,
                "mean_ms": statistics.fmean(lat[k]) * 1e3,
            }
    return out


def retained(target, rollouts: int, turns: int = 10) -> dict:
    """10-turn conversations: a 560-char system prompt, 40-char user turns, 50-token replies
    (stub ids: one per character) -> prompts of 625..1588 ids, mean ~1.1k."""
    system = {"role": "system", "content": "s" * 560}
    store0 = target.store_bytes() if isinstance(target, Ours) else 0
    rss0 = target.server.rss()
    with httpx.Client(timeout=60) as client:
        prompt_lens = []
        for r in range(rollouts):
            url, headers = target.new_rollout()
            messages = [system, {"role": "user", "content": f"{r:04d}" * 10}]
            for t in range(turns):
                _, data = call(client, url, headers, messages)
                prompt_lens.append(len(data["prompt_token_ids"]))
                messages += [data["choices"][0]["message"], {"role": "user", "content": f"{t:04d}" * 10}]
                messages[-2] = {"role": "assistant", "content": messages[-2]["content"]}
    n = rollouts * turns
    rss = (target.server.rss() - rss0) / n
    store = (target.store_bytes() - store0) / n if isinstance(target, Ours) else 0.0
    return {
        "rss_bytes_per_call": rss,
        "store_bytes_per_call": store,
        "retained_bytes_per_call": max(rss, 0) + store,
        "mean_prompt_ids": statistics.fmean(prompt_lens),
        "calls": n,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--skip-agl", action="store_true")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    dbs = {"ours": WORK / "gateway-bench.db", "ours_wb": WORK / "gateway-bench-wb.db"}
    for db in dbs.values():
        for suffix in ("", "-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)

    stub_port = free_port()
    stub_args = [PY, "-m", "tests.support.stub_upstream", "--port", str(stub_port)]
    stub = Server("stub", stub_args, f"http://127.0.0.1:{stub_port}/v1/models", {"PYTHONPATH": str(ROOT)})
    upstream = f"http://127.0.0.1:{stub_port}/v1"
    targets: dict = {}
    agl_error = None
    try:
        targets["ours"] = Ours(upstream, dbs["ours"])
        targets["ours_wb"] = Ours(upstream, dbs["ours_wb"], write_behind_ms=50.0)
        if not args.skip_agl:
            try:
                targets["agl"] = Agl(upstream)
            except Exception as exc:  # reported, and ours is still measured against the direct stub
                agl_error = f"{type(exc).__name__}: {exc}"
        stub_cpu0 = stub.cpu()
        res = cpu_and_latency(targets, f"{upstream}/chat/completions", args.calls)
        res["stub_cpu_ms_per_call"] = (
            (stub.cpu() - stub_cpu0) / (2 * (args.calls + 20) * len(targets)) * 1e3  # direct + proxied calls
        )
        for k, t in targets.items():
            res[k].update(retained(t, args.rollouts))
    finally:
        for t in targets.values():
            t.server.stop()
        stub.stop()

    print(json.dumps({**res, "agl_error": agl_error}, indent=2))
    a = res.get("agl")
    print(f"\nper proxied call (stub upstream, 200 prompt / 50 response ids; {args.calls} calls each)")
    print("ours = durable (response after span commit); ours_wb = --write-behind-ms 50")
    print(f"{'':24}{'ours':>11}{'ours_wb':>11}{'agl-server':>12}{'ours/agl':>10}{'wb/agl':>10}")
    rows = [
        ("server CPU ms/call", "cpu_ms_per_call"),
        ("added latency p50 ms", "added_p50_ms"),
        ("added latency p99 ms", "added_p99_ms"),
        ("retained bytes/call", "retained_bytes_per_call"),
    ]
    for label, key in rows:
        o, w = res["ours"][key], res["ours_wb"][key]
        if a:
            print(f"{label:24}{o:11.2f}{w:11.2f}{a[key]:12.2f}{o / a[key]:10.3f}{w / a[key]:10.3f}")
        else:
            print(f"{label:24}{o:11.2f}{w:11.2f}{'n/a':>12}")
    direct = " ".join(
        f"{k} {v['direct_p50_ms']:.2f}/{v['direct_p99_ms']:.2f}" for k, v in res.items() if k in targets
    )
    print(
        f"direct upstream p50/p99 ms in each block: {direct}; stub CPU ms/call {res['stub_cpu_ms_per_call']:.2f}"
    )
    for k in ("ours", "ours_wb"):
        o = res[k]
        print(
            f"{k} retained: RSS {o['rss_bytes_per_call']:.0f} B + store {o['store_bytes_per_call']:.0f} B per call "
            f"(mean prompt {o['mean_prompt_ids']:.0f} ids)"
        )
    if agl_error:
        print(f"agl-server could not be measured: {agl_error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
