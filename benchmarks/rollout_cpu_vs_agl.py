"""CPU per rollout of our path (runner + gateway + store) against Agent Lightning 1.0.2's (its local controller,
its agent processes, agl-server = its LLM proxy + in-memory store), for the same agent on the same episodes,
with the model engine excluded: both sides forward to one stub upstream (`tests.support.stub_upstream`, a
separate process whose CPU is not counted).

The agent (`AGENT` below, written once to benchmarks/.work/ld_bench_agent.py) is a plain function
`solve(task, client)` making `TURNS` chat.completions calls per episode (each reply appended, then a user turn),
reward 1 when the last reply holds the task's answer character; `BenchAgent` is the same function as an Agent
Lightning 1.0-style class whose `run()` reads the AGL_* variables and posts the reward event.

Sides, each with `--parallel` rollouts at once, the long-lived processes started and warmed up (a few
unmeasured rollouts) before the measured window:
  ours      `lightning-dagster gateway serve --upstream-url STUB --store-url sqlite:///...` and a fleet worker
            `lightning-dagster runner --project P --gateway URL` (harness `python: ld_bench_agent:solve`, in-process
            attempts: threads of the runner).
  ours-sub  the same, the harness `agl: ld_bench_agent:BenchAgent` (`--runner-mode subprocess`): one child
            process per attempt, as Agent Lightning's local runner does.
  agl       `agl-server` (Agent Lightning's venv; the stub registered as its model) and `agl-controller
            runner_type=local` (one `python -c ...` subprocess per rollout running `BenchAgent().run()`).
The window opens, N rollouts are queued by this script (ours: `rollouts enqueue`, a process not counted; agl:
one POST to /api/rollouts, whose handling by agl-server is counted), and closes when every rollout is final.
CPU = user + system seconds of each side's process trees (live descendants plus reaped children), read with
psutil at both ends of the window; nothing is subtracted. Idle polling is part of both designs and is counted;
its rate (CPU ms per idle second, measured over `--idle-s` before the window) is printed too. The sides take
turns (ours, ours-sub, agl, ours, ...) `--runs` times; each run starts fresh processes and stores.

    .venv/bin/python benchmarks/rollout_cpu_vs_agl.py [--n 100] [--runs 2] [--parallel 8] [--sides ours,agl]

(`--sides ours,ours-sub,agl` adds the subprocess row: ~2.5 min more per run on 2 loaded cores.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway_vs_agl import AGL_AUTH, AGL_KEY, PY, ROOT, WORK, Server, free_port, wait_http  # noqa: E402

from tests.support.agl_venv import ensure_agl_venv  # noqa: E402

TURNS = 3
AGENT = f'''"""The benchmark's agent: {TURNS} chat turns per episode, written once for both sides."""
import json
import os

import httpx
from openai import OpenAI

TURNS = {TURNS}


def solve(task, client):
    messages = [
        {{"role": "system", "content": "Answer with one character, then check your answer."}},
        {{"role": "user", "content": task["question"]}},
    ]
    text = ""
    for turn in range(TURNS):
        response = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=50, temperature=1.0
        )
        text = response.choices[0].message.content or ""
        messages += [
            {{"role": "assistant", "content": text}},
            {{"role": "user", "content": f"Check it again ({{turn + 1}})."}},
        ]
    return 1.0 if task["answer"] in text else 0.0


class BenchAgent:
    """`solve` as an Agent Lightning 1.0-style agent: `run()` reads the AGL_* variables, posts its reward."""

    def run(self):
        task = json.loads(os.environ["AGL_TASK"])
        key = os.environ["AGL_KEY"]
        with OpenAI(base_url=os.environ["AGL_OPENAI_BASE_URL"], api_key=key, max_retries=1, timeout=60.0) as client:
            reward = solve(task, client)
        httpx.post(
            os.environ["AGL_EVENT_URL"],
            json={{"event_type": "reward", "data": {{"value": reward}}}},
            headers={{"Authorization": "Bearer " + key}},
            timeout=30.0,
        ).raise_for_status()
'''
SECRET, ADMIN = "bench-secret-0123456789abcdef", "bench-admin-0123456789abcdef"


def tasks(n: int) -> list[dict]:
    return [
        {"task_id": f"t{i:04d}", "family": "f", "split": "train", "question": f"Task {i}: {i * 7919 % 1000}?",
         "answer": "0123456789abcdef"[i % 16]}
        for i in range(n)
    ]  # fmt: skip


def tree_cpu(pid: int) -> float:
    """User + system seconds of `pid` and its live descendants, plus the children they reaped."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:  # exited since listed: its time went to its parent's reaped children
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def own_and_children(pid: int) -> tuple[float, float]:
    """(the process's own seconds, its descendants' seconds: live ones plus reaped ones)."""
    own = psutil.Process(pid).cpu_times()
    return own.user + own.system, tree_cpu(pid) - own.user - own.system


def secret(path: Path, value: str) -> str:
    path.write_text(value)
    path.chmod(0o600)
    return str(path)


def start(args: list[str], cwd: Path, env: dict | None = None) -> subprocess.Popen:
    log = open(cwd / f"{Path(args[0]).name}-{len(list(cwd.iterdir()))}.log", "w")  # noqa: SIM115
    return subprocess.Popen(args, cwd=cwd, env={**os.environ, **(env or {})}, stdout=log, stderr=log)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(done, what: str, timeout: float, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:4]} exited with {p.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.5)


class OursSide:
    def __init__(self, name: str, upstream: str, run_dir: Path, parallel: int, subprocess_mode: bool):
        from lightning_dagster.store import Store

        self.name, self.dir = name, run_dir
        project = run_dir / "project"
        project.mkdir(parents=True)
        (project / "ld_bench_agent.py").write_text(AGENT)
        all_tasks = tasks(4096)
        (project / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in all_tasks))
        harness = "agl: ld_bench_agent:BenchAgent" if subprocess_mode else "python: ld_bench_agent:solve"
        (project / "lightning-dagster.yaml").write_text(
            f"name: bench\nharness:\n  {harness}\n  expected_spans: [llm, reward]\n"
            "training:\n  attempt_timeout_s: 300\n  max_attempts: 1\n"
            "tasks:\n  path: tasks.jsonl\n  id_column: task_id\n  family_column: family\n  split_column: split\n"
        )
        self.project = project
        self.store_url = f"sqlite:///{run_dir / 'store.db'}"
        self.store = Store(self.store_url)
        secret_file = secret(run_dir / "secret", SECRET)
        port = free_port()
        cli = [PY, "-m", "lightning_dagster.cli"]
        env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(project)])}
        gateway = [*cli, "gateway", "serve", "--upstream-url", upstream, "--port", str(port)]
        gateway += ["--store-url", self.store_url, "--secret-file", secret_file]
        gateway += ["--admin-key-file", secret(run_dir / "admin", ADMIN)]
        self.gateway = start(gateway, run_dir, env)
        wait_http(f"http://127.0.0.1:{port}/admin/health", self.gateway)
        runner = [*cli, "runner", "--project", str(project), "--store-url", self.store_url]
        runner += ["--gateway", f"http://127.0.0.1:{port}", "--secret-file", secret_file]
        runner += ["--parallel", str(parallel), "--max-attempts", "1", "--attempt-timeout-s", "300"]
        runner += ["--runner-mode", "subprocess" if subprocess_mode else "inprocess"]
        self.runner = start(runner, run_dir, env)
        self.procs = {"runner": self.runner.pid, "gateway": self.gateway.pid}
        self.queued = 0
        self.seed = 0

    def enqueue(self, n: int) -> None:
        self.seed += 1
        cmd = [PY, "-m", "lightning_dagster.cli", "rollouts", "enqueue", "--project", str(self.project)]
        cmd += ["--store-url", self.store_url, "--n", str(n), "--group-size", "1", "--seed", str(self.seed)]
        subprocess.run(
            cmd, check=True, capture_output=True, cwd=self.dir, env={**os.environ, "PYTHONPATH": str(ROOT)}
        )
        self.queued += n

    def finished(self) -> bool:
        return self.store.count_rollouts(status=["queued", "running"]) == 0

    def roles(self) -> dict[str, float]:
        runner_own, runner_children = own_and_children(self.runner.pid)
        return {
            "runner": runner_own,
            "agent processes": runner_children,
            "gateway + store": tree_cpu(self.gateway.pid),
        }

    def check(self, n_measured: int) -> dict:
        ok = self.store.count_rollouts(status="succeeded")
        assert ok == self.queued, f"{self.name}: {ok} of {self.queued} rollouts succeeded"
        llm, reward = self.store.count_spans(kind="llm"), self.store.count_spans(kind="reward")
        return {"llm_calls_per_rollout": llm / self.queued, "rewards_per_rollout": reward / self.queued}

    def close(self) -> None:
        stop(self.runner)
        stop(self.gateway)
        self.store.close()


class AglSide:
    name = "agl"

    def __init__(self, upstream: str, run_dir: Path, parallel: int, poll_s: float):
        python = ensure_agl_venv()
        self.dir = run_dir
        run_dir.mkdir(parents=True)
        (run_dir / "ld_bench_agent.py").write_text(AGENT)
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        server = [str(python.parent / "agl-server"), "host=127.0.0.1", f"port={port}", f"key={AGL_KEY}"]
        server += ["default_proxy.model_name=stub", "hydra.run.dir=."]
        self.server = start(server, run_dir, {"PYTHONPATH": ""})
        wait_http(f"{self.base}/healthz", self.server)
        httpx.post(
            f"{self.base}/api/models", json=[{"model": "stub", "endpoint": upstream}], headers=AGL_AUTH
        ).raise_for_status()
        controller = [
            str(python.parent / "agl-controller"),
            "runner_type=local",
            f"agl_server.url={self.base}",
        ]
        controller += [f"agl_server.key={AGL_KEY}", f"local_runner.maximum_size={parallel}"]
        controller += [f"local_runner.poll_interval={poll_s}", "hydra.run.dir=."]
        self.controller = start(controller, run_dir, {"PYTHONPATH": str(run_dir)})
        self.procs = {"controller": self.controller.pid, "agl-server": self.server.pid}
        self.ids: list[str] = []
        self.client = httpx.Client(base_url=self.base, headers=AGL_AUTH, timeout=60)

    def enqueue(self, n: int) -> None:
        config = {"timeout_seconds": 300, "local": {"agent_class": "ld_bench_agent:BenchAgent",
                                                    "env_map": {"AGL_TASK": "input"}}}  # fmt: skip
        start_at = len(self.ids)
        items = [
            {"input": t, "rollout_id": f"r{start_at + i:05d}", "config": config}
            for i, t in enumerate(tasks(n))
        ]
        self.client.post("/api/rollouts", json=items).raise_for_status()
        self.ids += [item["rollout_id"] for item in items]

    def finished(self) -> bool:
        params = [("state_in", "queuing"), ("state_in", "running"), ("limit", 1)]
        return not self.client.get("/api/rollouts", params=params).json()

    def roles(self) -> dict[str, float]:
        controller_own, agents = own_and_children(self.controller.pid)
        return {
            "runner": controller_own,
            "agent processes": agents,
            "gateway + store": tree_cpu(self.server.pid),
        }

    def check(self, n_measured: int) -> dict:
        llm = rewards = 0
        for rid in self.ids:
            rollout = self.client.get(f"/api/rollouts/{rid}").json()
            state = rollout["rollout"]["status"]["state"]  # RolloutDetail: the rollout and its attempts
            assert state == "succeeded", f"agl: rollout {rid} ended {state}: {rollout}"
            events = self.client.get(f"/api/rollouts/{rid}/events").json()
            llm += sum(e["event_type"] == "model_request" for e in events)
            rewards += sum(e["event_type"] == "reward" for e in events)
        return {"llm_calls_per_rollout": llm / len(self.ids), "rewards_per_rollout": rewards / len(self.ids)}

    def close(self) -> None:
        stop(self.controller)
        stop(self.server)
        self.client.close()


def measure(side, n: int, warmup: int, idle_s: float, stub: Server) -> dict:
    procs = [side.runner if isinstance(side, OursSide) else side.controller]
    side.enqueue(warmup)
    wait_until(side.finished, f"{side.name} warm-up", 600, procs)
    time.sleep(1.0)
    idle0, t0 = side.roles(), time.monotonic()
    time.sleep(idle_s)
    idle1, idle_wall = side.roles(), time.monotonic() - t0
    cpu0, stub0, wall0 = side.roles(), stub.cpu(), time.monotonic()
    side.enqueue(n)
    wait_until(side.finished, f"{side.name} rollouts", 1200, procs)
    wall = time.monotonic() - wall0
    cpu1, stub1 = side.roles(), stub.cpu()
    per = {role: round((cpu1[role] - cpu0[role]) / n * 1e3, 6) + 0.0 for role in cpu0}  # no -0.0
    idle = sum(idle1.values()) - sum(idle0.values())
    return {
        "ms_per_rollout": per,
        "total_ms_per_rollout": sum(per.values()),
        "idle_ms_per_s": idle / idle_wall * 1e3,
        "stub_ms_per_rollout": (stub1 - stub0) / n * 1e3,
        "wall_s": wall,
        "rollouts_per_s": n / wall,
        **side.check(n),
    }


def bare(upstream: str, n: int, parallel: int) -> dict:
    """The agent alone: `solve` on the same tasks straight against the stub, `parallel` threads of this warm
    process, no runner, gateway or store: `fresh` builds an OpenAI client (its own pool) per episode, as an
    agent process does; `shared` gives each episode's client one shared httpx pool, as our in-process harness
    does (`project.harness.http_client`). The agent's own work, which every side's figure includes."""
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    path = WORK / "ld_bench_agent.py"
    path.write_text(AGENT)
    spec = importlib.util.spec_from_file_location("ld_bench_agent", path)
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    pool_client = httpx.Client(
        limits=httpx.Limits(max_connections=64, max_keepalive_connections=8), timeout=60
    )
    out = {}
    for variant in ("fresh", "shared"):

        def episode(task: dict, variant: str = variant) -> float:
            shared = {"http_client": pool_client} if variant == "shared" else {}
            client = OpenAI(base_url=upstream, api_key="none", max_retries=1, timeout=60.0, **shared)
            try:
                return agent.solve(task, client)
            finally:
                if variant == "fresh":
                    client.close()

        episode(tasks(1)[0])
        cpu0 = time.process_time()
        with ThreadPoolExecutor(parallel) as pool:
            list(pool.map(episode, tasks(n)))
        out[f"{variant}_ms_per_episode"] = (time.process_time() - cpu0) / n * 1e3
    pool_client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100, help="measured rollouts per side and run")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--idle-s", type=float, default=3.0)
    parser.add_argument(
        "--agl-poll-s", type=float, default=0.5, help="agl-controller local_runner.poll_interval"
    )
    parser.add_argument("--sides", default="ours,agl", help="of ours, ours-sub, agl")
    args = parser.parse_args()
    sides = args.sides.split(",")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = WORK / f"rollout-cpu-{stamp}"
    base.mkdir(parents=True)
    stub_port = free_port()
    stub = Server(
        "stub",
        [PY, "-m", "tests.support.stub_upstream", "--port", str(stub_port)],
        f"http://127.0.0.1:{stub_port}/v1/models",
        {"PYTHONPATH": str(ROOT)},
    )
    upstream = f"http://127.0.0.1:{stub_port}/v1"
    load0 = os.getloadavg()
    results: list[tuple[int, str, dict]] = []
    try:
        for run in range(args.runs):
            for name in sides:
                run_dir = base / f"{run}-{name}"
                if name == "agl":
                    side = AglSide(upstream, run_dir, args.parallel, args.agl_poll_s)
                else:
                    side = OursSide(
                        name, upstream, run_dir, args.parallel, subprocess_mode=name == "ours-sub"
                    )
                try:
                    res = measure(side, args.n, args.warmup, args.idle_s, stub)
                finally:
                    side.close()
                res["load"] = os.getloadavg()[0]
                results.append((run, name, res))
                print(f"run {run} {name}: {json.dumps(res)}", flush=True)
            res = bare(upstream, args.n, args.parallel)
            results.append((run, "bare", res))
            print(f"run {run} bare agent: {json.dumps(res)}", flush=True)
    finally:
        stub.stop()

    print(
        f"\nCPU ms per rollout ({args.n} rollouts per side and run, {TURNS} LLM calls each, parallel "
        f"{args.parallel}; stub upstream not counted; agl-controller poll {args.agl_poll_s}s)"
    )
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average at start {load0[0]:.1f}")
    roles = ("runner", "agent processes", "gateway + store")
    print(f"{'run':>3} {'side':9}" + "".join(f"{r:>17}" for r in roles)
          + f"{'total':>9}{'llm/rollout':>12}{'rollouts/s':>11}{'idle ms/s':>10}{'load':>6}")  # fmt: skip
    for run, name, r in results:
        if name == "bare":
            continue
        cells = "".join(f"{r['ms_per_rollout'][role]:17.1f}" for role in roles)
        print(
            f"{run:>3} {name:9}{cells}{r['total_ms_per_rollout']:9.1f}{r['llm_calls_per_rollout']:12.2f}"
            f"{r['rollouts_per_s']:11.2f}{r['idle_ms_per_s']:10.1f}{r['load']:6.1f}"
        )
    by_run = {(run, name): r for run, name, r in results}
    for variant in ("fresh", "shared"):
        cells = ", ".join(
            f"run {run}: {r[f'{variant}_ms_per_episode']:.1f}" for run, name, r in results if name == "bare"
        )
        print(
            f"bare agent, {variant} client (solve() straight to the stub, no runner/gateway) ms/episode: {cells}"
        )
    if "agl" in sides:
        print("\nratio ours/agl of total CPU per rollout (target: <= 0.333)")
        for run in range(args.runs):
            agl = by_run[(run, "agl")]
            for name in sides:
                if name != "agl":
                    r = by_run[(run, name)]
                    print(f"run {run} {name:9} {r['total_ms_per_rollout'] / agl['total_ms_per_rollout']:.3f}")
        print(
            "\nwithout the agent: ours = runner - bare shared-client episode + gateway; agl = controller + agl-server"
            "\n(its agent processes out: interpreter start, imports, the agent's own calls). An estimate: the bare"
            "\nepisode is measured apart, in this process"
        )
        for run in range(args.runs):
            agl, b = by_run[(run, "agl")], by_run[(run, "bare")]
            infra_agl = agl["ms_per_rollout"]["runner"] + agl["ms_per_rollout"]["gateway + store"]
            if (run, "ours") in by_run:
                r = by_run[(run, "ours")]["ms_per_rollout"]
                infra = r["runner"] - b["shared_ms_per_episode"] + r["gateway + store"]
                print(
                    f"run {run} ours {infra:7.1f} ms   agl {infra_agl:7.1f} ms   ours/agl {infra / infra_agl:.3f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
