"""RL through the real runner and gateway: rollouts of the harness, their recorded spans, one update per step.

for each step:
    enqueue tasks x group train rollouts (store) -> Runner (in-process) -> GatewayServer -> engine
    read each rollout's final attempt: spans -> merged rows, reward -> rollout-level advantage
    one trainer step -> Engine.load_weights(new weights), so the next step samples from the new policy
every `eval_every` steps: held-out success sampled at T=1.0 with one fixed evaluation seed (common random
numbers: the gateway derives each call's seed from the rollout's `sampling_seed`), greedy beside it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_dagster.engine import BatchingEngine, Engine
from lightning_dagster.engine.chat import ChatCodec
from lightning_dagster.gateway import EngineBackend, GatewayServer, create_app
from lightning_dagster.gateway.process import GatewayProcess
from lightning_dagster.harnesses.registry import get_harness
from lightning_dagster.runner import RetryPolicy, Runner, sampling_seed
from lightning_dagster.store import Store
from lightning_dagster.training.advantages import AdvantageMode, RolloutReward, compute_advantages
from lightning_dagster.training.trainer import Trainer, TrainerConfig
from lightning_dagster.training.transitions import Row, TransitionConfig, merge_calls
from lightning_dagster.types import AttemptState, Rollout, RolloutKind, Span

Serving = Literal["thread", "process"]


@dataclass
class RLConfig:
    harness: str = "calc"
    steps: int = 40
    tasks_per_step: int = 16
    group_size: int = 16
    temperature: float = 1.0
    advantage: AdvantageMode = "grpo"
    eval_every: int = 10  # also evaluated before the first step and after the last
    heldout_tasks: int = 300
    eval_seed: int = 20261130
    greedy_every_eval: bool = False  # greedy only for the parent and the final candidate unless set
    seed: int = 0
    parallel: int = 64
    serving: Serving = "process"  # the gateway + engine in a child process (see RolloutService)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    transitions: TransitionConfig = field(default_factory=TransitionConfig)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutBatch:
    """Finished rollouts with the spans and reward of each one's final successful attempt."""

    rollouts: list[Rollout]
    rewards: dict[str, float]  # rollout_id -> reward; rollouts without a successful attempt are absent
    spans: dict[str, list[Span]]  # rollout_id -> spans of the rewarded attempt
    seconds: float

    def success(self) -> float:
        """Mean reward counting rollouts that never finished as 0."""
        return sum(self.rewards.values()) / len(self.rollouts) if self.rollouts else 0.0


# ----------------------------------------------------------------------------------------------------------
# the serving side: store + engine + gateway + runner, all real, in one process


class RolloutService:
    """Runs harness rollouts through a live gateway backed by the embedded engine. The trainer pushes new
    weights with `load_weights`; the resource id recorded on spans follows it.

    `serving="process"` runs the gateway and engine in a child process (`gateway.process`): the harness
    workers, the HTTP server and the decode loop then no longer share one interpreter lock, which made
    rollouts ~1.4x faster on the calc harness (benchmarks/README.md, training). It needs a store other
    processes can open (a SQLite file or PostgreSQL). `serving="thread"` keeps everything in this process.
    `codec` is the checkpoint's text side (render, decode, parse tool calls) in either mode."""

    def __init__(
        self,
        store: Store,
        model_dir: Path | str,
        *,
        harness: str,
        resource_id: str | None,
        parallel: int,
        serving: Serving = "thread",
    ):
        if serving not in ("thread", "process"):
            raise ValueError(f"serving must be 'thread' or 'process', got {serving!r}")
        self.store = store
        self.harness = get_harness(harness)
        self.serving = serving
        self.resource_id = resource_id
        secret = secrets.token_hex(16)
        self.process: GatewayProcess | None = None
        self.server: GatewayServer | None = None
        if serving == "process":
            if store.engine.url.get_backend_name() == "sqlite" and store.engine.url.database in (
                None,
                "",
                ":memory:",
            ):
                raise ValueError(
                    "serving='process' needs a store another process can open, not in-memory SQLite"
                )
            self.process = GatewayProcess(
                store.url, model_dir, secret=secret, resource_id=resource_id, max_batch=max(parallel, 16)
            )
            self.codec: Any = ChatCodec(model_dir)
            url = self.process.url
        else:
            self.engine = Engine(model_dir)
            self.batching = BatchingEngine(self.engine, max_batch=max(parallel, 16))
            self.backend = EngineBackend(self.batching, resource_id)
            app = create_app(store, self.backend, secret=secret, admin_key=secrets.token_hex(16))
            self.server = GatewayServer(app)
            self.server.start()
            self.codec = self.engine
            url = self.server.url
        self.runner = Runner(
            store,
            url,
            secret=secret,
            harness=self.harness,
            parallel=parallel,
            policy=RetryPolicy(max_attempts=1, timeout_s=120.0),
            mode="inprocess",
        )

    def close(self) -> None:
        if self.process is not None:
            self.process.stop()
        if self.server is not None:
            self.server.stop()
            self.batching.close()

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_weights(self, state_dict: dict, resource_id: str | None = None) -> None:
        """Serve `state_dict` from the next call on; spans record `resource_id`."""
        if self.process is not None:
            self.process.load_weights(state_dict, resource_id)
        else:
            self.engine.load_weights(state_dict)
            self.backend.resource_id = resource_id
        self.resource_id = resource_id

    def run(
        self,
        tasks: list[dict],
        *,
        group: int,
        kind: RolloutKind,
        temperature: float,
        seed: int | None,
        tag: str,
    ) -> RolloutBatch:
        """Run every task `group` times. With `seed`, member g of task t samples with the runner's
        `sampling_seed(seed, task_id, g)`: the same seed gives parent and candidate common random numbers."""
        started = time.perf_counter()
        rollouts = []
        for t, task in enumerate(tasks):
            group_id = f"{tag}-g{t}" if group > 1 else None
            for g in range(group):
                meta: dict[str, Any] = {"temperature": temperature}
                if seed is not None:
                    meta["sampling_seed"] = sampling_seed(seed, task["task_id"], g)
                rollouts.append(
                    Rollout(
                        kind=kind,
                        task_id=task["task_id"],
                        task=task,
                        group_id=group_id,
                        resource_id=self.resource_id,
                        harness=self.harness.name,
                        metadata=meta,
                    )
                )
        rollouts = self.store.enqueue_rollouts(rollouts)
        ids = [r.rollout_id for r in rollouts]
        with _temperature(temperature):
            self.runner.run(ids)
        return self._collect(rollouts, time.perf_counter() - started)

    def _collect(self, rollouts: list[Rollout], seconds: float) -> RolloutBatch:
        ids = [r.rollout_id for r in rollouts]
        final: dict[str, str] = {}
        for a in sorted(self.store.list_attempts(rollout_ids=ids), key=lambda a: a.sequence_id):
            if a.state == AttemptState.succeeded:
                final[a.rollout_id] = a.attempt_id
        rewards: dict[str, float] = {}
        for rw in self.store.list_rewards(rollout_ids=ids):
            if rw.rollout_id in final and rw.attempt_id in (None, final[rw.rollout_id]):
                rewards[rw.rollout_id] = rw.value  # the last reward of the final attempt wins
        spans: dict[str, list[Span]] = {}
        for s in self.store.list_spans(rollout_ids=ids):
            if final.get(s.rollout_id) == s.attempt_id:
                spans.setdefault(s.rollout_id, []).append(s)
        return RolloutBatch(rollouts=rollouts, rewards=rewards, spans=spans, seconds=seconds)


@contextlib.contextmanager
def _temperature(value: float) -> Iterator[None]:
    """The calc harness reads its sampling temperature from `CALC_TEMPERATURE` (it knows nothing of
    rollouts); in-process runs share this process's environment, so set it around the run."""
    old = os.environ.get("CALC_TEMPERATURE")
    os.environ["CALC_TEMPERATURE"] = repr(float(value))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CALC_TEMPERATURE", None)
        else:
            os.environ["CALC_TEMPERATURE"] = old


# ----------------------------------------------------------------------------------------------------------
# evaluation and one RL step


def evaluate(service: RolloutService, tasks: list[dict], *, seed: int, tag: str, greedy: bool = True) -> dict:
    """Held-out success sampled at T=1.0 with the fixed evaluation seed (and greedy beside it)."""
    sampled = service.run(tasks, group=1, kind=RolloutKind.holdout, temperature=1.0, seed=seed, tag=tag)
    out = {"success": sampled.success(), "eval_seconds": sampled.seconds, "tasks": len(tasks)}
    if greedy:
        g = service.run(tasks, group=1, kind=RolloutKind.holdout, temperature=0.0, seed=seed, tag=tag)
        out.update(greedy=g.success(), eval_seconds=out["eval_seconds"] + g.seconds)
    return out


def rows_and_rewards(
    batch: RolloutBatch, config: TransitionConfig
) -> tuple[list[Row], list[RolloutReward], dict[str, float | int]]:
    """The batch's training rows and one reward per rollout (only rollouts with both)."""
    rows: list[Row] = []
    rewards: list[RolloutReward] = []
    stats = None
    for r in batch.rollouts:
        if r.rollout_id not in batch.rewards or r.rollout_id not in batch.spans:
            continue
        attempt_rows, s = merge_calls(batch.spans[r.rollout_id], config)
        if stats is None:
            stats = s
        else:
            stats.add(s)
        rows.extend(attempt_rows)
        rewards.append(RolloutReward(r.rollout_id, r.group_id, batch.rewards[r.rollout_id]))
    merge = stats.to_dict() if stats is not None else {}
    return rows, rewards, {f"merge_{k}": v for k, v in merge.items()}


@dataclass
class RLResult:
    parent: dict
    candidate: dict
    curve: list[dict]  # one entry per evaluation: step, rl_seconds, success (and greedy when measured)
    steps: list[dict]  # trainer metrics per step
    seconds: float
    rl_seconds: float
    checkpoint: Path | None


def train_rl(
    store: Store,
    parent_dir: Path | str,
    config: RLConfig,
    *,
    parent_resource_id: str | None = None,
    out_dir: Path | str | None = None,
    log: Any = None,
) -> RLResult:
    """RL from `parent_dir`; returns the evaluations, per-step metrics and (with `out_dir`) the checkpoint."""
    started = time.perf_counter()
    harness = get_harness(config.harness)
    heldout = harness.make_tasks("holdout", config.heldout_tasks, config.seed)
    train_pool = harness.make_tasks("train", config.steps * config.tasks_per_step, config.seed)
    trainer = Trainer(parent_dir, config.trainer)
    curve: list[dict] = []
    metrics: list[dict] = []
    rl_seconds = 0.0

    def record(step: int, greedy: bool) -> dict:
        ev = evaluate(service, heldout, seed=config.eval_seed, tag=f"eval{step}", greedy=greedy)
        point = {"step": step, "rl_seconds": rl_seconds, **ev}
        curve.append(point)
        if log:
            log(point)
        return point

    with RolloutService(
        store,
        parent_dir,
        harness=config.harness,
        resource_id=parent_resource_id,
        parallel=config.parallel,
        serving=config.serving,
    ) as service:
        parent = record(0, greedy=True)
        for step in range(1, config.steps + 1):
            t0 = time.perf_counter()
            tasks = train_pool[(step - 1) * config.tasks_per_step : step * config.tasks_per_step]
            batch = service.run(
                tasks,
                group=config.group_size,
                kind=RolloutKind.train,
                temperature=config.temperature,
                seed=config.seed * 100_000 + step,
                tag=f"s{step}",
            )
            rows, rewards, merge = rows_and_rewards(batch, config.transitions)
            advantages = compute_advantages(rewards, config.advantage)
            m = trainer.step(rows, advantages, extra={**merge, "rollout_seconds": batch.seconds})
            service.load_weights(trainer.state_dict())
            rl_seconds += time.perf_counter() - t0
            m["rl_seconds"] = rl_seconds
            metrics.append(m)
            if log:
                log(m)
            last = step == config.steps
            if last or step % config.eval_every == 0:
                record(step, greedy=last or config.greedy_every_eval)
        candidate = curve[-1]
    checkpoint = trainer.save(out_dir) if out_dir is not None else None
    return RLResult(
        parent=parent,
        candidate=candidate,
        curve=curve,
        steps=metrics,
        seconds=time.perf_counter() - started,
        rl_seconds=rl_seconds,
        checkpoint=checkpoint,
    )
