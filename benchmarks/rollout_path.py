"""One RL step's rollouts through the real path against a bare batched sampling loop, side by side in one run.

**path**: `RolloutService` as the pipeline's `candidate_resource` runs it (`pipeline.serving.rollout_service`:
the gateway and engine in a child process, in-process calc harness attempts under the runner, a SQLite file
store), the demo's step (16 tasks x group 16, T=1.0, the calc agent's 48 tokens a call). **bare**: the same
model in this process, one `RunningBatch` kept full by one loop (no HTTP, no store, no harness thread): each
episode is the calc agent's (tool calls parsed and run, the tool turn appended to the exact ids, at most 3
calls), every call seeded as the gateway seeds it, so both sides sample the same tokens (checked).

Prints rollouts/s of both, the ratio, and where the path's extra time goes: engine occupancy (rows per decode
step, decode steps, admissions, the engine's busy share of the wall, from the gateway's `/admin/stats`), CPU
of the runner's process and of the gateway's against the bare loop's, and the summed call latency. For a
profile of either process, attach py-spy to the pids during a round (benchmarks/README.md has one).

`--split` adds the path with the engine in a process of its own (`engine_process`), alternated with the others.

Run: .venv/bin/python benchmarks/rollout_path.py [--parent DIR] [--rounds 3] [--parallel 16]
(without --parent it builds the base model and gives it `--sft-steps` supervised steps on the calc
demonstrations, so that it calls the calculator and episodes have several turns).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dagster.engine import Engine, SamplingParams, build_base_model
from lightning_dagster.engine.batch import RunningBatch
from lightning_dagster.gateway.tokenin import closing_tokens
from lightning_dagster.harnesses.calc.agent import (
    MAX_TOKENS,
    MAX_TURNS,
    SYSTEM_PROMPT,
    TOOLS,
    extract_answer,
    run_tool,
    score,
)
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.project.examples import example_tasks
from lightning_dagster.runner.enqueue import sampling_seed
from lightning_dagster.runner.service import RolloutService
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store
from lightning_dagster.training.step import step_seed
from lightning_dagster.types import RolloutKind, Sampling, SpanKind


def prepare_model(work: Path, sft_steps: int) -> Path:
    """The embedded base model (as the tests build it) after `sft_steps` warm-start steps on the calc demos."""
    from lightning_dagster.project.config import load_project
    from lightning_dagster.project.examples import example_file
    from lightning_dagster.training.trainer import Trainer, TrainerConfig
    from lightning_dagster.training.warmstart import demo_rows, load_demos, split_demos

    base = build_base_model(work / "base", corpus=training_corpus(seed=0), seed=0)
    project = load_project(example_file("calc"))
    assert project.model is not None and project.model.warm_start is not None
    demos, _ = split_demos(load_demos(project.model.warm_start, project.file), 0)
    # the warm start's own optimizer (`WarmStartConfig.lr`), supervised steps only
    trainer = Trainer(
        base, TrainerConfig(lr=3e-3, device="auto", loss=None, betas=(0.9, 0.99), grad_clip=1.0)
    )
    codec = Engine(base)
    rows = demo_rows(codec, demos, 32 * sft_steps, 0)
    for i in range(sft_steps):
        trainer.supervised_step(rows[32 * i : 32 * (i + 1)])
    return trainer.save(work / "sft")


def call_seed(rollout_seed: int, call: int) -> int:
    """The gateway's per-call seed (`AttemptContext.call_seed`)."""
    return int.from_bytes(hashlib.sha256(f"{rollout_seed}:{call}".encode()).digest()[:4], "big") >> 1


@dataclass
class Episode:
    task: dict
    seed: int
    messages: list[dict] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    responses: list[list[int]] = field(default_factory=list)
    reward: float = 0.0


class BareLoop:
    """The calc agent's episodes driven straight on the engine's running batch, `max_batch` rows at most."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        self.engine, self.max_batch = engine, max_batch
        self.closing = closing_tokens(lambda m, t, g: engine.render(m, t, add_generation_prompt=g)) or []
        self.steps = self.rows = 0
        self.host_s = 0.0  # episode logic: parsing, tools, building the next prompt

    def params(self, ep: Episode, temperature: float) -> SamplingParams:
        return SamplingParams(
            temperature=temperature, max_tokens=MAX_TOKENS, seed=call_seed(ep.seed, len(ep.prompts) - 1)
        )

    def first(self, ep: Episode) -> list[int]:
        ep.messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": ep.task["question"]},
        ]
        ep.prompts.append(self.engine.render(ep.messages, TOOLS))
        return ep.prompts[-1]

    def advance(self, ep: Episode, gen: Any) -> list[int] | None:
        """The agent's turn after a call: the next prompt (exact ids + the tool turn), or None when done."""
        ep.responses.append(list(gen.token_ids))
        content, calls = self.engine.parse_assistant(gen.text)
        if not calls:
            ep.reward = score(extract_answer(content), ep.task["answer"])
            return None
        if len(ep.prompts) == MAX_TURNS:
            return None
        ids = ep.prompts[-1] + ep.responses[-1]
        glue = self.closing[1:] if self.closing and ids[-1] == self.closing[0] else self.closing
        tools = [
            {"role": "tool", "content": run_tool(c["function"]["name"], c["function"]["arguments"])}
            for c in calls
        ]
        ep.prompts.append(ids + glue + self.engine.render(tools, None))
        return ep.prompts[-1]

    def run(self, episodes: list[Episode], temperature: float) -> None:
        engine, batch = self.engine, RunningBatch(self.engine)
        waiting: deque[tuple[Episode, list[int]]] = deque((ep, self.first(ep)) for ep in episodes)
        with engine.exclusive():
            while waiting or batch:
                room = self.max_batch - len(batch)
                if room and waiting:
                    take = [waiting.popleft() for _ in range(min(room, len(waiting)))]
                    outcomes = batch.admit(
                        [p for _, p in take],
                        [self.params(ep, temperature) for ep, _ in take],
                        [ep for ep, _ in take],
                    )
                else:
                    self.steps += 1
                    self.rows += len(batch)
                    outcomes = batch.step()
                t0 = time.perf_counter()
                for ep, gen in outcomes:
                    if isinstance(gen, BaseException):
                        raise gen
                    nxt = self.advance(ep, gen)
                    if nxt is not None:
                        waiting.appendleft((ep, nxt))  # a next turn goes before episodes not started yet
                self.host_s += time.perf_counter() - t0


def child_cpu(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (the gateway and, split off, its engine process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    total = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:  # a thread that ended since the listing
            continue
        for child in children:
            total += child_cpu(int(child))
    return total


def run_path(svc: RolloutService, tasks: list[dict], group: int, seed: int, tag: str) -> dict:
    gw = svc.gateway
    before = gw.stats()
    c_child, c_self, t0 = child_cpu(gw.pid), time.process_time(), time.perf_counter()
    batch = svc.run(
        tasks, group=group, kind=RolloutKind.train, sampling=Sampling(temperature=1.0), seed=seed, tag=tag
    )
    wall = time.perf_counter() - t0
    after = gw.stats()
    eng = {k: after["engine"][k] - before["engine"][k] for k in after["engine"]}
    calls = [s for spans in batch.spans.values() for s in spans if s.kind == SpanKind.llm]
    by_seed = {}
    for r in batch.rollouts:
        prompts = [
            list(s.prompt_token_ids) for s in batch.spans.get(r.rollout_id, []) if s.kind == SpanKind.llm
        ]
        responses = [
            list(s.response_token_ids) for s in batch.spans.get(r.rollout_id, []) if s.kind == SpanKind.llm
        ]
        by_seed[r.metadata["sampling_seed"]] = (prompts, responses)
    return {
        "wall": wall,
        "n": len(batch.rollouts),
        "success": batch.success(),
        "calls": len(calls),
        "tokens": sum(len(s.response_token_ids) for s in calls),
        "cpu_runner": time.process_time() - c_self,
        "cpu_gateway": child_cpu(gw.pid) - c_child,
        "engine": eng,
        "latency": sum(s.attributes["latency_s"] for s in calls),
        "episodes": by_seed,
    }


def run_bare(engine: Engine, tasks: list[dict], group: int, seed: int, max_batch: int) -> dict:
    episodes = [Episode(t, sampling_seed(seed, str(t["task_id"]), g)) for t in tasks for g in range(group)]
    loop = BareLoop(engine, max_batch)
    c0, t0 = time.process_time(), time.perf_counter()
    loop.run(episodes, 1.0)
    wall = time.perf_counter() - t0
    return {
        "wall": wall,
        "n": len(episodes),
        "success": sum(e.reward for e in episodes) / len(episodes),
        "calls": sum(len(e.prompts) for e in episodes),
        "tokens": sum(len(r) for e in episodes for r in e.responses),
        "cpu": time.process_time() - c0,
        "steps": loop.steps,
        "rows": loop.rows,
        "host_s": loop.host_s,
        "episodes": {e.seed: (e.prompts, e.responses) for e in episodes},
    }


def same_episodes(a: dict, b: dict) -> tuple[int, int]:
    """(episodes whose every prompt and response is identical on both sides, episodes)."""
    return sum(a.get(k) == v for k, v in b.items()), len(b)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parent", type=Path)
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument(
        "--parallel", type=int, default=16, help="runner workers (the pipeline's gateway.parallel)"
    )
    parser.add_argument(
        "--split-parallel", type=int, default=None,
        help="runner workers of the --split path (default: --parallel); more than max_batch keeps its batch full",
    )  # fmt: skip
    parser.add_argument("--max-batch", type=int, default=64, help="the pipeline's model.max_batch")
    parser.add_argument("--threads", type=int, default=2, help="engine torch threads (model.engine_threads)")
    parser.add_argument(
        "--split", action="store_true",
        help="also run the path with the engine in a process of its own (ServingSettings.engine_process)",
    )  # fmt: skip
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ld-rollout-path-"))
    model = args.parent or prepare_model(work, args.sft_steps)
    store = Store(f"sqlite:///{work / 'store.db'}")
    tasks = example_tasks("calc").draw("train", args.tasks * args.rounds, 0)
    t0 = time.perf_counter()
    extra = ["split"] if args.split else []
    services = {}
    for side in ("path", *extra):
        serving = ServingSettings(
            parallel=args.split_parallel or args.parallel if side == "split" else args.parallel,
            runner_mode="inprocess",
            max_batch=args.max_batch,
            engine_threads=args.threads,
            engine_process=side == "split",
        )
        services[side] = RolloutService(store, model, harness="calc", serving=serving, child=True)
    startup = time.perf_counter() - t0
    engine = Engine(model, threads=args.threads)
    print(f"load average {os.getloadavg()[0]:.1f}; model {model}; {args.tasks} tasks x group {args.group}, "
          f"parallel {args.parallel}, max_batch {args.max_batch}, threads {args.threads}; "
          f"service start {startup:.2f} s (once per stage)", flush=True)  # fmt: skip
    for side, service in services.items():
        run_path(service, tasks[:2], 2, 99, f"warmup-{side}")
    run_bare(engine, tasks[:2], 2, 99, args.max_batch)
    results: dict[str, list[dict]] = {"path": [], "bare": [], **{side: [] for side in extra}}
    try:
        for r in range(args.rounds):
            chunk = tasks[r * args.tasks : (r + 1) * args.tasks]
            seed = step_seed(0, r + 2)
            order = [s for s in ("path", "split", "bare") if s in results]
            for side in order if r % 2 == 0 else order[::-1]:
                if side in services:
                    res = run_path(services[side], chunk, args.group, seed, f"r{r}-{side}")
                else:
                    if engine.prefix_cache is not None:  # no reuse of the previous round's keys
                        engine.prefix_cache.clear()
                    res = run_bare(engine, chunk, args.group, seed, args.max_batch)
                results[side].append(res)
            p, b = results["path"][-1], results["bare"][-1]
            same, n = same_episodes(p["episodes"], b["episodes"])
            pe, ratio = p["engine"], (p["n"] / p["wall"]) / (b["n"] / b["wall"])
            print(
                f"round {r}: path {p['n'] / p['wall']:6.1f} rollouts/s ({p['wall']:5.2f} s)  "
                f"bare {b['n'] / b['wall']:6.1f} rollouts/s ({b['wall']:5.2f} s)  path/bare {ratio:.3f}  "
                f"identical episodes {same}/{n}",
                flush=True,
            )
            print(
                f"   calls {p['calls']} vs {b['calls']}, tokens {p['tokens']} vs {b['tokens']}, "
                f"success {p['success']:.3f} vs {b['success']:.3f}\n"
                f"   rows per decode step {pe['rows_stepped'] / max(1, pe['steps_run']):5.1f} vs "
                f"{b['rows'] / max(1, b['steps']):5.1f}; decode steps {pe['steps_run']} vs {b['steps']}; "
                f"admissions {pe['batches_run']}; engine busy {pe['busy_s']:5.2f} s of {p['wall']:5.2f} s "
                f"({pe['busy_s'] / p['wall']:.0%}) vs bare {b['wall'] - b['host_s']:5.2f} s\n"
                f"   CPU: runner process {p['cpu_runner']:5.2f} s, gateway process {p['cpu_gateway']:5.2f} s "
                f"(engine busy {pe['busy_s']:5.2f} s) vs bare {b['cpu']:5.2f} s; "
                f"call latency sum {p['latency']:6.1f} s (mean {p['latency'] / max(1, p['calls']) * 1e3:5.0f} ms)",
                flush=True,
            )
            for side in extra:
                i = results[side][-1]
                ie = i["engine"]
                same, n = same_episodes(i["episodes"], b["episodes"])
                print(
                    f"   engine in its own process: {i['n'] / i['wall']:6.1f} rollouts/s "
                    f"({i['wall']:5.2f} s), {side}/bare {(i['n'] / i['wall']) / (b['n'] / b['wall']):.3f}, "
                    f"identical episodes {same}/{n}; rows per decode step "
                    f"{ie['rows_stepped'] / max(1, ie['steps_run']):5.1f}, decode steps {ie['steps_run']}, "
                    f"engine busy {ie['busy_s']:5.2f} s; CPU runner {i['cpu_runner']:5.2f} s, "
                    f"gateway + engine processes {i['cpu_gateway']:5.2f} s",
                    flush=True,
                )
    finally:
        for service in services.values():
            service.close()
    med = {s: statistics.median(x["n"] / x["wall"] for x in results[s]) for s in results}
    print(
        f"median rollouts/s: path {med['path']:.1f}  bare {med['bare']:.1f}  path/bare {med['path'] / med['bare']:.3f}"
        + "".join(f"  {side} {med[side]:.1f}  {side}/bare {med[side] / med['bare']:.3f}" for side in extra)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
