"""The first parent: a supervised warm start on the project's ideal episodes, stopped early on purpose.

Demonstrations (the project's `model.warm_start` file) are rendered through the engine's own chat template
and only assistant tokens are trained. Stopping rule: GRPO learns only from groups whose rewards differ, so
training stops as soon as the sampled success at T=1.0 on a small probe of train tasks reaches about
0.2-0.4. The window is only a few SFT steps wide, so once a cheap teacher-forced estimate says it is near,
the probe runs through the same runner + gateway as RL, more often the closer it gets (`probe_gap`).
"""

from __future__ import annotations

import json
import math
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_dagster import paths
from lightning_dagster.engine.build import checkpoint_hash
from lightning_dagster.engine.chat import ChatCodec
from lightning_dagster.project import Project, ProjectError, load_project, load_tasks
from lightning_dagster.project.harness import harness_spec
from lightning_dagster.training.trainer import MicroBatch, Trainer, TrainerConfig, collate, response_logprobs
from lightning_dagster.training.transitions import Row
from lightning_dagster.types import Resource, RolloutKind, Sampling

if TYPE_CHECKING:
    from lightning_dagster.settings import ServingSettings
    from lightning_dagster.store import Store


HELD_DEMOS = 64  # demonstrations kept out of training to estimate the warm start's progress


class DemoRenderError(ValueError):
    """A demonstration does not render prefix-preservingly, so its assistant tokens cannot be located."""


@dataclass(kw_only=True)
class WarmStartConfig:
    """The first parent's warm start; the fields without a default are the user's (`warm_start_config`)."""

    project: str  # the project file: its demos, harness, train tasks
    seed: int
    max_steps: int
    probe_tasks: int
    demos: int
    device: str  # where the SFT trainer runs
    serving: ServingSettings  # the probe's gateway, engine and runner
    lr: float = 3e-3
    # Rows per SFT step: at least batch_size, and enough to hold batch_tokens trained tokens (batch_rows); a
    # project whose replies are a few tokens long learns too slowly in 32 rows (benchmarks/README.md, the
    # first parent's warm start on short replies).
    batch_size: int = 32
    batch_tokens: int = 384
    min_steps: int = 4  # (at most max_steps)
    probe_every: int = 2  # steps between estimates of the demonstrations' probability (see estimate_gap)
    probe_seed: int = 7
    window: tuple[float, float] = (0.2, 0.4)
    # Stop once the probe reaches this: a later stop inside the window learned faster under RL on calc
    # (benchmarks/README.md, training, learning curve).
    target: float | None = 0.3  # None: the window's lower edge

    def to_dict(self) -> dict[str, Any]:
        """What the warm-started resource records, without the gateway secret. Not `asdict`: the serving
        settings may be a Dagster resource, which cannot be deep-copied."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "serving"}
        return out | {"serving": self.serving.model_dump(mode="json", exclude={"secret"})}


def demo_row(engine: Any, messages: list[dict], tools: list[dict] | None, eos_ids: set[int]) -> Row:
    """One rendered conversation as a row: everything before the first assistant turn is the prompt; each
    assistant turn's tokens through its end-of-turn token have mask 1, the rest (tool results, headers) 0."""
    full = engine.render(messages, tools, add_generation_prompt=False)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise DemoRenderError("a demonstration needs at least one assistant message")
    mask = [0] * len(full)
    for i in turns:
        prefix = engine.render(messages[:i], tools, add_generation_prompt=True)
        start = end = len(prefix)
        if prefix != full[:start]:
            raise DemoRenderError(f"rendering is not prefix-preserving before message {i}")
        while end < len(full) and full[end] not in eos_ids:
            end += 1
        mask[start : end + 1] = [1] * len(full[start : end + 1])
    first = len(engine.render(messages[: turns[0]], tools, add_generation_prompt=True))
    last = max(j for j, m in enumerate(mask) if m) + 1
    return Row(
        rollout_id="demo",
        attempt_id="demo",
        prompt_ids=full[:first],
        response_ids=full[first:last],
        loss_mask=mask[first:last],
        behaviour_logprobs=[0.0] * (last - first),
        temperature=1.0,  # a demonstration is learned (and probed) under the model's own distribution
        span_ids=[],
    )


def load_demos(file: Path, project_file: Path) -> list[dict[str, Any]]:
    """The demonstrations file: one `{"messages": [...], "tools": [...]}` object a line (`tools` optional)."""
    demos: list[dict[str, Any]] = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            demo = json.loads(line)
        except json.JSONDecodeError as err:
            raise ProjectError(project_file, [("model.warm_start", f"{file} line {number}: {err}")]) from None
        if not isinstance(demo, dict) or not isinstance(demo.get("messages"), list):
            problem = f'{file} line {number}: expected an object with a "messages" list'
            raise ProjectError(project_file, [("model.warm_start", problem)])
        demos.append(demo)
    if len(demos) <= HELD_DEMOS:
        problem = f"{file} has {len(demos)} demonstrations; the warm start needs more than {HELD_DEMOS}"
        raise ProjectError(project_file, [("model.warm_start", problem)])
    return demos


def split_demos(demos: list[dict[str, Any]], seed: int) -> tuple[list[dict], list[dict]]:
    """(train, held): a seeded shuffle, the first HELD_DEMOS held out."""
    order = random.Random(seed).sample(demos, len(demos))
    return order[HELD_DEMOS:], order[:HELD_DEMOS]


def demo_rows(engine: Any, demos: list[dict[str, Any]], n: int, seed: int) -> list[Row]:
    """`n` rows of the demonstrations: seeded passes over them, each in its own order, until `n`."""
    rng = random.Random(seed)
    drawn: list[dict[str, Any]] = []
    while len(drawn) < n:
        drawn += rng.sample(demos, len(demos))
    return [demo_row(engine, d["messages"], d.get("tools"), engine.eos_token_ids) for d in drawn[:n]]


def base_model(project: Project, seed: int) -> Path:
    """The project's `model.path`, else the embedded default, built in `<home>/models/base` if absent."""
    if project.model is not None and project.model.path is not None:
        return project.model.path
    from lightning_dagster.engine.build import build_base_model, default_corpus

    base = paths.models_dir() / "base"
    if not (base / "config.json").is_file():
        build_base_model(base, corpus=default_corpus(), seed=seed)
    return base


def has_demos(project: Project) -> bool:
    return project.model is not None and project.model.warm_start is not None


def probe_gap(success: float, window: tuple[float, float]) -> int:
    """SFT steps until the next sampled probe (probing every step or every other one, the demo's warm start
    spent 240 of its 420 s in probes: benchmarks/README.md, the whole demo)."""
    return 1 if success >= window[0] else 2 if success >= window[0] / 2 else 4


def batch_rows(rows: list[Row], config: WarmStartConfig) -> int:
    """Rows per SFT step: `batch_size`, or enough rows of the mean trained length to hold `batch_tokens`
    (at most every row). The starter's replies train 6 tokens a row (`89+24` and an end of turn), calc's 28:
    at 32 rows the starter's demonstrations still had probability 0.02 after 300 steps, at 64 they reached
    0.36 by step 200."""
    mean = sum(r.trained_tokens for r in rows) / len(rows)
    return min(len(rows), max(config.batch_size, math.ceil(config.batch_tokens / mean)))


def estimate_gap(estimate: float, window: tuple[float, float], every: int) -> int:
    """SFT steps until the next teacher-forced estimate: an estimate costs ~3/4 of an SFT step (0.35 vs
    0.45 s on 2 cores for the embedded model) and climbs gradually from 0."""
    return every if estimate >= window[0] / 16 else 4 * every


def demo_probability(model: Any, held: MicroBatch) -> float:
    """Mean probability of a held-out demonstration's assistant tokens at T=1: a cheap estimate of success."""
    with torch.no_grad():
        logp = response_logprobs(model, held)
    return float(torch.exp((logp * held.mask).sum(dim=1)).mean())


def render_demos(
    codec: Any, train: list[dict], held: list[dict], config: WarmStartConfig
) -> tuple[list[Row], MicroBatch]:
    """The training rows and the held-out batch the cheap estimate scores."""
    rows = demo_rows(codec, train, config.demos, config.seed)
    return rows, collate(demo_rows(codec, held, HELD_DEMOS, config.seed + 2), list(range(HELD_DEMOS)))


def _close_when_started(serving: Future) -> None:
    """Close the probe's service once its start has finished (a failed start has nothing to close: its error
    was reported by the probe that needed it, if any did)."""
    if serving.exception() is None:
        serving.result().close()


@dataclass
class WarmStartResult:
    model_dir: Path
    resource: Resource
    steps: int
    probe_success: float
    history: list[dict]
    seconds: float
    steps_run: int = 0  # SFT steps trained; `steps` is the step of the checkpoint kept (see warm_start)


def warm_start(
    store: Store, base_dir: Path | str, out_dir: Path | str, config: WarmStartConfig, *, log: Any = None
) -> WarmStartResult:
    """SFT from `base_dir` until the probe's sampled success enters the window; save and register it."""
    from lightning_dagster.gateway.options import serving_settings
    from lightning_dagster.runner.service import RolloutService  # the serving stack, only needed here

    started = time.perf_counter()
    project = load_project(config.project)
    if project.model is None or project.model.warm_start is None:
        raise ProjectError(project.file, [("model.warm_start", "the warm start needs a demonstrations file")])
    train_demos, held_demos = split_demos(load_demos(project.model.warm_start, project.file), config.seed)
    tasks = load_tasks(project)
    tasks.require_splits(["train"])
    probe = tasks.draw("train", config.probe_tasks, config.seed + 1)
    trainer = Trainer(base_dir, TrainerConfig(lr=config.lr, device=config.device, loss=None))
    history: list[dict] = []
    success = 0.0
    # The probe's gateway starts (seconds: a child process importing torch and loading the model) and the
    # demonstrations render (seconds of chat templates) while the first SFT steps run; a child left by an
    # earlier reusing gateway of this process is taken instead (`gateway.pool`), and this one is left for
    # the pipeline's first stage.
    pool = ThreadPoolExecutor(2, thread_name_prefix="warm-start")
    rendered = pool.submit(render_demos, ChatCodec(base_dir), train_demos, held_demos, config)
    # it serves the weights it trains: the embedded engine, never an upstream; a fresh secret
    own = serving_settings(config.serving, secret="", upstream_url="")
    serving = pool.submit(
        RolloutService, store, base_dir, harness=harness_spec(project), serving=own, child=True, reuse=True
    )
    pool.shutdown(wait=False)
    try:
        rows, held = rendered.result()
        rng, per_step = random.Random(config.seed), batch_rows(rows, config)
        near, probed, estimated, estimate = False, 0, 0, 0.0
        goal = config.target or config.window[0]
        min_steps = min(config.min_steps, config.max_steps)
        # the probed checkpoint nearest the goal: (step, success, weights); what the warm start
        # ends with when it runs out of steps before a probe reaches the goal (probes swing by +-0.1 from
        # one step to the next at this learning rate, so the last step is often not the best one probed)
        best: tuple[int, float, dict] | None = None
        reached = False
        for step in range(1, config.max_steps + 1):
            m = trainer.supervised_step(rng.sample(rows, per_step))
            # the estimate only says when to start probing: once near, the probes decide
            if not near and step - estimated >= estimate_gap(estimate, config.window, config.probe_every):
                estimated, estimate = step, demo_probability(trainer.model, held)
                m["demo_probability"] = estimate
            near = near or m.get("demo_probability", 0.0) >= config.window[0] / 4
            if step >= min_steps and near and step - probed >= probe_gap(success, config.window):
                probed = step
                svc = serving.result()
                svc.load_weights(trainer.state_dict())
                kind, sampling, tag = RolloutKind.train, Sampling(temperature=1.0), f"warm{step}"
                batch = svc.run(probe, group=1, kind=kind, sampling=sampling, seed=config.probe_seed, tag=tag)
                success = batch.success()
                m.update(probe_success=success, probe_seconds=batch.seconds)
                if best is None or abs(success - goal) <= abs(best[1] - goal):
                    best = (step, success, trainer.state_dict())
            history.append(m)
            if log:
                log(m)
            if "probe_success" in m and success >= goal:
                reached = True
                break
    finally:
        _close_when_started(serving)
    chosen = trainer.steps
    if not reached and best is not None and best[0] != trainer.steps:
        chosen, success, weights = best
        trainer.model.load_state_dict(weights)
        if log:
            log({"step": trainer.steps, "chosen_step": chosen, "probe_success": success})
    out = trainer.save(out_dir)
    meta = {
        "role": "warm_start",
        "project": project.name,
        "base_dir": str(base_dir),
        "sft_steps": chosen,
        "sft_steps_run": trainer.steps,
        "sft_rows_per_step": per_step,
        "probe_success": success,
        "config": config.to_dict(),
    }
    resource = store.add_resource(Resource(uri=str(out), weights_hash=checkpoint_hash(out), metadata=meta))
    return WarmStartResult(
        out, resource, chosen, success, history, time.perf_counter() - started, steps_run=trainer.steps
    )
