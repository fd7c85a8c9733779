"""The first parent: a supervised warm start on the harness's ideal episodes, stopped early on purpose.

Demonstrations come from `lightning_dagster.harnesses.<name>.demos` (OpenAI message sequences) and are
rendered through the engine's own chat template, so the tokens learned are the tokens the gateway will
render and the engine will sample. Only assistant tokens (through each turn's end-of-turn token) are trained.

Stopping rule: GRPO learns only from groups whose rewards differ, so training stops as soon as the sampled
success at T=1.0 on a small probe set reaches about 0.2-0.4. A parent near 0 or near 1 sampled success gives
nearly every group equal rewards, hence no advantage and nothing to learn. The window is only a few SFT steps
wide, so the probe runs often, through the same runner + gateway as RL.
"""

from __future__ import annotations

import importlib
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lightning_dagster.engine.build import checkpoint_hash
from lightning_dagster.harnesses.registry import get_harness
from lightning_dagster.training.trainer import MicroBatch, Trainer, TrainerConfig, collate, response_logprobs
from lightning_dagster.training.transitions import Row
from lightning_dagster.types import Resource, RolloutKind, Sampling

if TYPE_CHECKING:
    from lightning_dagster.gateway.local import Serving
    from lightning_dagster.store import Store


class DemoRenderError(ValueError):
    """A demonstration does not render prefix-preservingly, so its assistant tokens cannot be located."""


@dataclass
class WarmStartConfig:
    harness: str = "calc"
    lr: float = 3e-3
    batch_size: int = 32
    max_steps: int = 300
    min_steps: int = 4
    probe_every: int = 2  # steps between estimates of the demonstrations' probability
    probe_tasks: int = 64
    probe_seed: int = 7
    window: tuple[float, float] = (0.2, 0.4)
    # Stop once the probe reaches this: a later stop inside the window learned faster under RL on calc
    # (benchmarks/README.md, training, learning curve).
    target: float | None = 0.3  # None: the window's lower edge
    seed: int = 0
    demos: int = 2000
    parallel: int = 64
    serving: Serving = "process"  # where the probe's gateway + engine run (see RolloutService)


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
        start = len(prefix)
        if prefix != full[:start]:
            raise DemoRenderError(f"rendering is not prefix-preserving before message {i}")
        end = start
        while end < len(full) and full[end] not in eos_ids:
            end += 1
        for j in range(start, min(end + 1, len(full))):
            mask[j] = 1
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


def demo_rows(engine: Any, harness: str, n: int, seed: int) -> list[Row]:
    demos = importlib.import_module(f"lightning_dagster.harnesses.{harness}.demos")
    tools = demos.demo_tools()
    tasks = get_harness(harness).make_tasks("train", n, seed)
    return [demo_row(engine, demos.demo_messages(t), tools, engine.eos_token_ids) for t in tasks]


def demo_probability(model: Any, held: MicroBatch) -> float:
    """Mean probability of sampling a held-out demonstration's assistant tokens exactly at T=1: a cheap,
    teacher-forced lower estimate of sampled success (one forward pass, no sampling, no harness)."""
    with torch.no_grad():
        logp = response_logprobs(model, held)
    return float(torch.exp((logp * held.mask).sum(dim=1)).mean())


@dataclass
class WarmStartResult:
    model_dir: Path
    resource: Resource
    steps: int
    probe_success: float
    history: list[dict]
    seconds: float


def warm_start(
    store: Store, base_dir: Path | str, out_dir: Path | str, config: WarmStartConfig, *, log: Any = None
) -> WarmStartResult:
    """SFT from `base_dir` until the probe's sampled success enters the window; save and register it."""
    from lightning_dagster.runner.service import RolloutService  # the serving stack, only needed here

    started = time.perf_counter()
    trainer = Trainer(base_dir, TrainerConfig(lr=config.lr, betas=(0.9, 0.99), grad_clip=1.0))
    probe = get_harness(config.harness).make_tasks("train", config.probe_tasks, config.seed + 1)
    history: list[dict] = []
    success = 0.0
    with RolloutService(
        store,
        base_dir,
        harness=config.harness,
        resource_id=None,
        parallel=config.parallel,
        serving=config.serving,
    ) as svc:
        rows = demo_rows(svc.codec, config.harness, config.demos, config.seed)
        held = collate(demo_rows(svc.codec, config.harness, 64, config.seed + 2), list(range(64)))
        rng = random.Random(config.seed)
        for step in range(1, config.max_steps + 1):
            m = trainer.supervised_step(rng.sample(rows, config.batch_size))
            if step % config.probe_every == 0:
                m["demo_probability"] = demo_probability(trainer.model, held)
            # The sampled probe costs seconds; run it once the cheap estimate says the window is near,
            # then every step (the window is only a few steps wide).
            near = m.get("demo_probability", 0.0) >= config.window[0] / 4 or success >= config.window[0] / 2
            if step >= config.min_steps and near:
                svc.load_weights(trainer.state_dict())
                batch = svc.run(
                    probe,
                    group=1,
                    kind=RolloutKind.train,
                    sampling=Sampling(temperature=1.0),
                    seed=config.probe_seed,
                    tag=f"warm{step}",
                )
                success = batch.success()
                m.update(probe_success=success, probe_seconds=batch.seconds)
            history.append(m)
            if log:
                log(m)
            if "probe_success" in m and success >= (config.target or config.window[0]):
                break
    out = trainer.save(out_dir)
    resource = store.add_resource(
        Resource(
            uri=str(out),
            parent_id=None,
            weights_hash=checkpoint_hash(out),
            metadata={
                "role": "warm_start",
                "harness": config.harness,
                "base_dir": str(base_dir),
                "sft_steps": trainer.steps,
                "probe_success": success,
                "config": asdict(config),
            },
        )
    )
    return WarmStartResult(out, resource, trainer.steps, success, history, time.perf_counter() - started)
