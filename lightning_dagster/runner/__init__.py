"""The runner: claims rollouts and runs harness attempts under a retry policy; `RolloutService` runs them
through a local gateway."""

from lightning_dagster.runner.enqueue import enqueue_tasks, sampling_seed
from lightning_dagster.runner.retry import InvalidPolicy, RetryPolicy
from lightning_dagster.runner.runner import Runner, WrongHarness
from lightning_dagster.runner.service import RolloutBatch, RolloutService, collect_batch
from lightning_dagster.runner.summary import RunSummary, summarize

__all__ = [
    "InvalidPolicy", "RetryPolicy", "RolloutBatch", "RolloutService", "RunSummary", "Runner", "collect_batch",
    "enqueue_tasks", "sampling_seed", "summarize", "WrongHarness",
]  # fmt: skip
