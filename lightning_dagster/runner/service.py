"""Harness rollouts through a local gateway: queue, run (`Runner`), collect each final successful attempt."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.gateway.keys import GatewayKeys
from lightning_dagster.gateway.local import LocalGateway
from lightning_dagster.gateway.options import LoraSpec, gateway_options
from lightning_dagster.project.examples import example_harness
from lightning_dagster.runner.enqueue import enqueue_tasks
from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.runner.retry import RetryPolicy
from lightning_dagster.runner.runner import Runner
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store
from lightning_dagster.types import AttemptState, Resource, Rollout, RolloutKind, Sampling, Span

if TYPE_CHECKING:
    import torch


@dataclass
class RolloutBatch:
    """Finished rollouts with the spans and reward of each one's final successful attempt."""

    rollouts: list[Rollout]
    rewards: dict[str, float]  # rollout_id -> reward; rollouts without a successful attempt are absent
    spans: dict[str, list[Span]]  # rollout_id -> spans of the rewarded attempt
    seconds: float
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)  # `runner.summary.failures`

    def success(self) -> float:
        """Mean reward counting rollouts that never finished as 0."""
        return sum(self.rewards.values()) / len(self.rollouts) if self.rollouts else 0.0


def collect_batch(store: Store, rollouts: list[Rollout], seconds: float = 0.0) -> RolloutBatch:
    """Each rollout's final successful attempt (highest sequence), with its spans and its last reward."""
    ids = [r.rollout_id for r in rollouts]
    final: dict[str, str] = {}
    for a in sorted(store.list_attempts(rollout_ids=ids), key=lambda a: a.sequence_id):
        if a.state == AttemptState.succeeded:
            final[a.rollout_id] = a.attempt_id
    rewards: dict[str, float] = {}
    for rw in store.list_rewards(rollout_ids=ids):
        if rw.rollout_id in final and rw.attempt_id in (None, final[rw.rollout_id]):
            rewards[rw.rollout_id] = rw.value  # the last reward of the final attempt wins
    spans: dict[str, list[Span]] = {}
    for s in store.list_spans(rollout_ids=ids):
        if final.get(s.rollout_id) == s.attempt_id:
            spans.setdefault(s.rollout_id, []).append(s)
    return RolloutBatch(rollouts=rollouts, rewards=rewards, spans=spans, seconds=seconds)


def model_resource(store: Store, model_dir: Path) -> Resource:
    """The store's resource for `model_dir` with these exact weights, registered on first use."""
    from lightning_dagster.engine import checkpoint_hash

    weights = checkpoint_hash(model_dir)
    uri = str(model_dir.resolve())
    for resource in store.list_resources():
        if resource.uri == uri and resource.weights_hash == weights:
            return resource
    return store.add_resource(Resource(kind="model", uri=uri, weights_hash=weights))


class RolloutService:
    """Runs harness rollouts through a `LocalGateway` with a `Runner`; `load_weights` pushes new weights.
    `harness`: a built-in example's name or a spec; `child`, `reuse`: see `LocalGateway`."""

    def __init__(
        self,
        store: Store,
        model_dir: Path | str | None,
        *,
        harness: str | HarnessSpec,
        serving: ServingSettings | None = None,
        resource_id: str | None = None,
        retry_policy: RetryPolicy | None = None,
        child: bool = False,
        reuse: bool = False,
        lora: LoraSpec | None = None,
    ) -> None:
        serving = serving or ServingSettings()
        # vLLM hot-loads a LoRA adapter by name; the embedded engine is pushed the merged weights
        self.serves_adapters = lora is not None and serving.engine == "vllm"
        adapters = {"lora": lora} if self.serves_adapters else {}
        self.store = store
        self.harness = harness if isinstance(harness, HarnessSpec) else example_harness(harness)
        self.retry_policy = retry_policy or self.harness.retry_policy()
        options = gateway_options(serving, model_names=list(self.harness.model_names), **adapters)
        keys = GatewayKeys.fresh(serving.secret) if serving.secret else None
        self.gateway = LocalGateway(
            store, model_dir, options, keys=keys, resource_id=resource_id, child=child, reuse=reuse
        )
        decode = self.gateway.codec.decode if self.gateway.codec is not None else None
        try:
            self.runner = Runner(
                store, self.gateway.url, secret=self.gateway.secret, harness=self.harness,
                parallel=serving.attempts_at_once(), policy=self.retry_policy, mode=serving.runner_mode,
                sandbox=serving.sandbox, decode=decode,
            )  # fmt: skip
        except BaseException:
            self.gateway.close()
            raise

    @property
    def codec(self) -> Any:
        """An `Engine` or a `ChatCodec` (see `LocalGateway`)."""
        return self.gateway.codec

    @property
    def resource_id(self) -> str | None:
        return self.gateway.resource_id

    def close(self) -> None:
        self.gateway.close()

    def __enter__(self) -> RolloutService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_weights(self, state_dict: dict[str, torch.Tensor], resource_id: str | None = None) -> None:
        """Serve `state_dict` from the next call on; spans record `resource_id`."""
        self.gateway.load_weights(state_dict, resource_id)

    def run(
        self,
        tasks: list[dict],
        *,
        group: int,
        kind: RolloutKind,
        sampling: Sampling,
        seed: int | None,
        tag: str,
        snapshot_key: str | None = None,
    ) -> RolloutBatch:
        """Run every task `group` times with `sampling` applied to every call; group ids `<tag>-g<t>`."""
        started = time.perf_counter()
        self.gateway.verify()  # no rollout counts on weights the engine does not (or no longer) serve
        rollouts = enqueue_tasks(
            self.store, self.harness, tasks, kind=kind, group_size=group, seed=seed, tag=tag,
            resource_id=self.resource_id, snapshot_key=snapshot_key, sampling=sampling,
        )  # fmt: skip
        summary = self.runner.run([r.rollout_id for r in rollouts])
        batch = collect_batch(self.store, rollouts, time.perf_counter() - started)
        batch.failures = summary.failures
        return batch
