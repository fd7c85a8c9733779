"""Every call the pipeline makes into the serving layer (gateway, engine, runner), and the settings they
read: the stages only see `rollout_service`, `collect` and `retry_policy`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.types import Rollout, Span, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.pipeline.run import Pipeline
    from lightning_dagster.runner import RetryPolicy
    from lightning_dagster.runner.harness_spec import HarnessSpec
    from lightning_dagster.runner.service import RolloutBatch, RolloutService
    from lightning_dagster.store import Store


def retry_policy(p: Pipeline, spec: HarnessSpec) -> RetryPolicy:
    """The retry policy a stage's rollouts of `spec` run under (`training.configs.retry_policy`); staleness
    fingerprints what this gives for the training harness."""
    from lightning_dagster.training.configs import retry_policy as of_settings

    return of_settings(p.training, spec)


class SnapshotService:
    """A gateway, engine and runner serving one model for one snapshot's rollouts (tagged with its key)."""

    def __init__(self, service: RolloutService, snapshot_key: str) -> None:
        self.service, self.snapshot_key = service, snapshot_key

    def __enter__(self) -> SnapshotService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.service.close()

    def run(self, tasks: list[dict], **kw: Any) -> RolloutBatch:
        """`RolloutService.run`, tagged with the snapshot key; member g of task t samples with seed (seed, task,
        g) (common random numbers across the models a snapshot compares)."""
        return self.service.run(tasks, **kw, snapshot_key=self.snapshot_key)

    def load_weights(self, state_dict: dict, resource_id: str) -> None:
        """Serve `state_dict` from the next call on; spans record `resource_id`."""
        self.service.load_weights(state_dict, resource_id)

    def tools_called(self, spans: list[Span]) -> set[str]:
        """Names of the tools the model called in the responses of these LLM spans."""
        codec = self.service.codec
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
    harness: HarnessSpec,
    resource_id: str,
    serves_parent: bool,
) -> SnapshotService:
    """The service for one stage. A stage that only serves the parent may use an upstream, forwarded from a
    gateway in this process. Otherwise gateway and engine run in a child process (no interpreter lock shared
    with the trainer), reused by the next stage with the same settings instead of starting one (~10 s)."""
    from lightning_dagster.gateway.options import serving_settings
    from lightning_dagster.runner.service import RolloutService
    from lightning_dagster.training.configs import lora_spec

    upstream, tokenizer = upstream_of(p)
    forwards = serves_parent and upstream is not None
    serving = ctx.settings(p).serving
    service = RolloutService(
        p.get_store(),
        tokenizer if forwards else model_dir,
        harness=harness,
        serving=serving_settings(serving, upstream_url=upstream if forwards else ""),
        resource_id=resource_id,
        retry_policy=retry_policy(p, harness),
        child=not forwards,
        reuse=not forwards,
        lora=lora_spec(ctx.settings(p).training),
    )
    return SnapshotService(service, snapshot_key)


def upstream_of(p: Pipeline) -> tuple[str | None, Path | None]:
    """The upstream that serves the parent (`serving.upstream_url`), and the project's `model.tokenizer`
    its token ids are read with (None: no upstream, or ids the gateway does not decode)."""
    upstream = ctx.settings(p).serving.upstream_url
    model = ctx.pipeline_project(p).model
    return (upstream, model.tokenizer if model is not None else None) if upstream else (None, None)


def spans_tokenizer(p: Pipeline, parent_dir: Path) -> Path:
    """The tokenizer folder whose ids the parent's rollouts recorded: the upstream's `model.tokenizer` when
    an upstream serves the parent (`rollout_service` with `serves_parent`), else the parent checkpoint's."""
    upstream, tokenizer = upstream_of(p)
    return tokenizer if upstream is not None and tokenizer is not None else parent_dir


def collect(store: Store, rollouts: list[Rollout]) -> RolloutBatch:
    """Finished rollouts read back from the store, by the same rule a live batch uses."""
    from lightning_dagster.runner.service import collect_batch

    return collect_batch(store, rollouts)
