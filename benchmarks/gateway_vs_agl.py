"""Our gateway (upstream mode) vs Agent Lightning 1.0.2's `agl-server`, side by side against one stub upstream
that returns vLLM-shaped JSON (200 prompt ids, 50 response ids with logprobs).

Measures, per proxied call: server CPU time (the scheduler's nanosecond count of the server process's
threads), added latency over
a direct upstream call (p50/p99; each call follows a direct one, the gateways take turns in rounds of 10
calls), and retained bytes on 10-turn rollouts with
~1k-token prompts (server RSS growth; for ours plus the growth of the SQLite store after a WAL checkpoint).
Ours is measured on its own route with attempt keys (`ours`, `ours_wb`) and on Agent Lightning's proxy path
(`ours_agl`, `gateway serve --agl-key-file`). Per REST call of Agent Lightning's API (create a rollout, list,
get one, post an event, read a rollout's triplet events): server CPU of ours (`--agl-key-file`) and of
agl-server, both with a server key, taking turns in rounds of 10 calls.

    .venv/bin/python benchmarks/gateway_vs_agl.py [--calls 300] [--rollouts 40] [--rest-calls 300]

Agent Lightning runs from its own Python 3.12 venv (benchmarks/.work/agl-venv, created on first use with
`pip install agentlightning==1.0.2`; `tests.support.agl_venv`).
"""

from __future__ import annotations

import argparse
import json
import os
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
sys.path.insert(0, str(ROOT))
from tests.support.agl_venv import ensure_agl_venv  # noqa: E402

WORK = ROOT / "benchmarks" / ".work"
PY = sys.executable
SECRET, ADMIN, AGL_KEY = "bench-secret-0123456789", "bench-admin-0123456789", "bench-agl-key-0123456789"
AGL_AUTH = {"Authorization": f"Bearer {AGL_KEY}"}
REST_ROUTES = ("create", "list", "get", "events_post", "events_get")


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
        """Seconds on a CPU of the process's live threads, in nanoseconds from the scheduler
        (`/proc/<pid>/task/<tid>/schedstat`): `cpu_times` counts 10 ms clock ticks, coarser than a block of
        10 calls (~5 ms), which left single routes' figures +-25% apart from run to run. A thread that exits
        between two readings takes its time with it; both servers keep their threads."""
        total = 0
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                continue
        return total / 1e9

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

    def __init__(self, upstream: str, db: Path, write_behind_ms: float = 0.0, agl: bool = False):
        from lightning_dagster.store import Store

        self.db = db
        self.store = Store(f"sqlite:///{db}")
        self.port = free_port()
        cli = str(Path(PY).parent / "lightning-dagster")
        args = [
            cli,
            "gateway",
            "serve",
            "--upstream-url",
            upstream,
            "--port",
            str(self.port),
            "--store-url",
            self.store.url,
        ]
        if write_behind_ms:
            args += ["--write-behind-ms", str(write_behind_ms)]
        # The gateway takes its secrets from 0600 files, never from its environment or command line.
        secrets = [("--secret-file", SECRET), ("--admin-key-file", ADMIN)] + [
            ("--agl-key-file", AGL_KEY)
        ] * agl
        for option, value in secrets:
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


class AglApi:
    """Rollouts made through Agent Lightning's REST API, called through its proxy path (ours or agl-server)."""

    n = 0
    base = ""

    def new_rollout(self) -> tuple[str, dict]:
        AglApi.n += 1
        rid = f"bench-{AglApi.n}"
        httpx.post(
            f"{self.base}/api/rollouts", json=[{"input": {}, "rollout_id": rid}], headers=AGL_AUTH
        ).raise_for_status()
        return f"{self.base}/proxy/rollout/{rid}/attempt/0/mode/train/openai/v1/chat/completions", AGL_AUTH


class OursAgl(AglApi, Ours):
    """Ours with `--agl-key-file`, called as agl-server is."""

    def __init__(self, upstream: str, db: Path):
        Ours.__init__(self, upstream, db, agl=True)
        self.base = f"http://127.0.0.1:{self.port}"


class Agl(AglApi):
    def __init__(self, upstream: str):
        exe = ensure_agl_venv().parent / "agl-server"
        self.port = free_port()
        args = [
            str(exe),
            "host=127.0.0.1",
            f"port={self.port}",
            f"key={AGL_KEY}",  # agl-server takes its key on the command line (hydra)
            "default_proxy.model_name=stub",
            "hydra.run.dir=.",
        ]
        self.server = Server("agl", args, f"http://127.0.0.1:{self.port}/healthz")
        self.base = f"http://127.0.0.1:{self.port}"
        models = [{"model": "stub", "endpoint": upstream}]
        httpx.post(f"{self.base}/api/models", json=models, headers=AGL_AUTH).raise_for_status()


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


def rest_call(client: httpx.Client, base: str, route: str, i: int, tag: str) -> None:
    """One call of `route`; `i` numbers the calls of a server, `tag` keeps its rollout ids apart."""
    if route == "create":
        item = {
            "input": {"question": "q" * 40, "data_id": f"d{i}"},
            "rollout_id": f"{tag}-c{i}",
            "metadata": {},
        }
        r = client.post(f"{base}/api/rollouts", json=[{**item, "config": {"timeout_seconds": 60}}])
    elif route == "list":
        r = client.get(
            f"{base}/api/rollouts", params=[("state_in", "queuing"), ("state_in", "running"), ("limit", 50)]
        )
    elif route == "get":
        r = client.get(f"{base}/api/rollouts/{tag}-r{i % 20}")
    elif route == "events_post":
        event = {"event_type": "tool_call", "data": {"step": i, "tool": "calc", "output": "x" * 100}}
        r = client.post(f"{base}/api/rollouts/{tag}-r{i % 20}/attempt/0/events", json=event)
    else:
        r = client.get(f"{base}/api/rollouts/{tag}-e/events", params={"format": "triplet"})
    r.raise_for_status()


def rest_cpu(targets: dict, calls: int) -> dict:
    """Server CPU per REST call of Agent Lightning's API, each server measured over its own blocks of 10
    calls (the servers take turns). Before: 20 running rollouts, and one (`-e`) with 4 proxied model calls
    and a reward, whose triplet events the `events_get` calls read."""
    msgs = [{"role": "user", "content": "x" * 183}]
    out: dict = {k: {} for k in targets}
    with httpx.Client(timeout=60, headers=AGL_AUTH) as client:
        for k, t in targets.items():
            items = [{"input": {"data_id": f"d{j}"}, "rollout_id": f"{k}-r{j}"} for j in range(20)]
            client.post(
                f"{t.base}/api/rollouts", json=[*items, {"input": {}, "rollout_id": f"{k}-e"}]
            ).raise_for_status()
            for j in range(20):
                client.patch(
                    f"{t.base}/api/rollouts/{k}-r{j}", json={"status": {"state": "running"}}
                ).raise_for_status()
            proxy = f"{t.base}/proxy/rollout/{k}-e/attempt/0/mode/train/openai/v1/chat/completions"
            for _ in range(4):
                call(client, proxy, AGL_AUTH, msgs)
                msgs = [*msgs, {"role": "user", "content": "y" * 20}]
            reward = {"event_type": "reward", "data": {"value": 1.0}}
            client.post(f"{t.base}/api/rollouts/{k}-e/attempt/0/events", json=reward).raise_for_status()
        for route in REST_ROUTES:
            spent = dict.fromkeys(targets, 0.0)
            for k, t in targets.items():  # warm-up
                for i in range(10):
                    rest_call(client, t.base, route, 10_000 + i, k)
            for start in range(0, calls, 10):
                for k, t in targets.items():
                    cpu0 = t.server.cpu()
                    for i in range(start, start + 10):
                        rest_call(client, t.base, route, i, k)
                    spent[k] += t.server.cpu() - cpu0
            for k in targets:
                out[k][route] = spent[k] / calls * 1e3
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rollouts", type=int, default=40)
    parser.add_argument("--rest-calls", type=int, default=300)
    parser.add_argument("--skip-agl", action="store_true")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    ours = ("ours", "ours_wb", "ours_agl")
    dbs = {k: WORK / f"gateway-bench-{k}.db" for k in ours}
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
        targets["ours_agl"] = OursAgl(upstream, dbs["ours_agl"])
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
        rest_targets = {k: t for k, t in targets.items() if k in ("ours_agl", "agl")}
        res["rest_cpu_ms_per_call"] = rest_cpu(rest_targets, args.rest_calls)
    finally:
        for t in targets.values():
            t.server.stop()
        stub.stop()

    print(json.dumps({**res, "agl_error": agl_error}, indent=2))
    a = res.get("agl")
    print(f"\nper proxied call (stub upstream, 200 prompt / 50 response ids; {args.calls} calls each)")
    print("ours = durable (response after span commit); ours_wb = --write-behind-ms 50;")
    print("ours_agl = durable, called on Agent Lightning's proxy path with its server key;")
    header = (
        "".join(f"{k:>11}" for k in ours) + f"{'agl-server':>12}" + "".join(f"{k + '/agl':>14}" for k in ours)
    )
    print(f"{'':24}{header}")
    rows = [
        ("server CPU ms/call", "cpu_ms_per_call"),
        ("added latency p50 ms", "added_p50_ms"),
        ("added latency p99 ms", "added_p99_ms"),
        ("retained bytes/call", "retained_bytes_per_call"),
    ]
    for label, key in rows:
        values = "".join(f"{res[k][key]:11.2f}" for k in ours)
        ratios = "".join(f"{res[k][key] / a[key]:14.3f}" for k in ours) if a else ""
        print(f"{label:24}{values}{a[key] if a else float('nan'):12.2f}{ratios}")
    rest = res["rest_cpu_ms_per_call"]
    if "agl" in rest:
        print(
            f"\nserver CPU ms per REST call ({args.rest_calls} calls each; ours = gateway serve --agl-key-file)"
        )
        print(f"{'route':24}{'ours':>11}{'agl-server':>12}{'ours/agl':>10}")
        for route in REST_ROUTES:
            o, g = rest["ours_agl"][route], rest["agl"][route]
            print(f"{route:24}{o:11.3f}{g:12.3f}{o / g:10.3f}")
    direct = " ".join(
        f"{k} {v['direct_p50_ms']:.2f}/{v['direct_p99_ms']:.2f}"
        for k, v in res.items()
        if k in targets and "direct_p50_ms" in v
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
