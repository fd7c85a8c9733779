"""The runner: claims rollouts, runs harness attempts (subprocess or in-process) with timeouts, heartbeats
and a declared retry policy, and keeps every attempt's ending and reason; a harness's judge scores an attempt
that posted no reward from its `transcript`; `RolloutService` runs them through a local gateway and
collects each rollout's final successful attempt."""

from lightning_dagster.runner.enqueue import enqueue_tasks, sampling_seed
from lightning_dagster.runner.retry import InvalidPolicy, RetryPolicy
from lightning_dagster.runner.runner import Runner, WrongHarness
from lightning_dagster.runner.service import RolloutBatch, RolloutService, collect_batch
from lightning_dagster.runner.summary import RunSummary, summarize

__all__ = [
    "InvalidPolicy",
    "RetryPolicy",
    "RolloutBatch",
    "RolloutService",
    "RunSummary",
    "Runner",
    "collect_batch",
    "enqueue_tasks",
    "sampling_seed",
    "summarize",
    "WrongHarness",
]
