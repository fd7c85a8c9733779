"""Every call the pipeline makes into the serving layer (gateway, engine, runner), and the settings they
read: the stages only see `rollout_service`, `collect` and `retry_policy`."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from lightning_dagster.types import Rollout, RolloutKind, Sampling, Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.pipeline.settings import Pipeline
    from lightning_dagster.runner import RetryPolicy
    from lightning_dagster.store import Store
    from lightning_dagster.training.loop import RolloutBatch, RolloutService

# One harness attempt on the embedded engine, with room for the slowest rollout of a 2-core machine.
ATTEMPT_TIMEOUT_S = 120.0


def retry_policy(p: Pipeline) -> RetryPolicy:
    """The retry policy every pipeline rollout runs under; staleness fingerprints this same object."""
    from lightning_dagster.runner import RetryPolicy

    return RetryPolicy(max_attempts=p.training.max_attempts, timeout_s=ATTEMPT_TIMEOUT_S)


class _SnapshotStore:
    """The store as `RolloutService.run` sees it: every rollout it enqueues carries the snapshot key, so the
    snapshot's rollouts are found by the indexed `Rollout.snapshot_key`."""

    def __init__(self, store: Store, snapshot_key: str) -> None:
        self._store = store
        self._snapshot_key = snapshot_key

    def enqueue_rollouts(self, rollouts: list[Rollout]) -> list[Rollout]:
        keyed = [r.model_copy(update={"snapshot_key": self._snapshot_key}) for r in rollouts]
        return self._store.enqueue_rollouts(keyed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


class SnapshotService:
    """A gateway, engine and runner serving one model for one snapshot's rollouts."""

    def __init__(self, service: RolloutService) -> None:
        self._service = service

    def __enter__(self) -> SnapshotService:
        return self

    def __exit__(self, *exc: object) -> None:
        self._service.close()

    def run(
        self, tasks: list[dict], *, group: int, kind: RolloutKind, sampling: Sampling, seed: int, tag: str
    ) -> RolloutBatch:
        """Every task `group` times; member g of task t samples with seed (seed, task, g) (common random
        numbers across the models a snapshot compares)."""
        return self._service.run(
            tasks, group=group, kind=kind, temperature=sampling.temperature, seed=seed, tag=tag
        )

    def load_weights(self, state_dict: dict, resource_id: str) -> None:
        """Serve `state_dict` from the next call on; spans record `resource_id`."""
        self._service.load_weights(state_dict, resource_id)

    def tools_called(self, spans: list[Span]) -> set[str]:
        """Names of the tools the model called in the responses of these LLM spans."""
        codec = self._service.codec
        return {
            call["function"]["name"]
            for s in spans
            if s.kind == SpanKind.llm and s.response_token_ids
            for call in codec.parse_assistant(codec.decode(s.response_token_ids))[1]
        }


def rollout_service(
    p: Pipeline,
    model_dir: Path,
    *,
    snapshot_key: str,
    harness: str,
    resource_id: str,
    serves_parent: bool,
) -> SnapshotService:
    """The service for one stage. One that only serves the parent runs in this process; one that serves
    weights this process trained or loads runs the gateway and engine in a child process, so the harness
    workers, the HTTP server and the decode loop do not share the trainer's interpreter lock."""
    from lightning_dagster.training.loop import RolloutService

    store = p.get_store()
    service = RolloutService(
        store,
        model_dir,
        harness=harness,
        resource_id=resource_id,
        parallel=p.gateway.parallel,
        serving="thread" if serves_parent else "process",
    )
    service.runner.policy = retry_policy(p)
    service.store = _SnapshotStore(store, snapshot_key)  # type: ignore[assignment]
    return SnapshotService(service)


def collect(store: Store, rollouts: list[Rollout]) -> RolloutBatch:
    """Finished rollouts read back from the store: the spans and reward of each one's final successful
    attempt, by the same rule a live batch uses."""
    from lightning_dagster.training.loop import RolloutService

    return RolloutService._collect(SimpleNamespace(store=store), rollouts, 0.0)  # type: ignore[arg-type]
