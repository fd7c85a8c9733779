"""The runner: claims rollouts, runs harness attempts (subprocess or in-process) with timeouts, heartbeats
and a declared retry policy, and keeps every attempt's ending and reason."""

from lightning_dagster.runner.policy import InvalidPolicy, RetryPolicy
from lightning_dagster.runner.rollouts import enqueue_tasks, sampling_seed
from lightning_dagster.runner.runner import Runner, WrongHarness
from lightning_dagster.runner.summary import RunSummary, summarize

__all__ = [
    "InvalidPolicy",
    "RetryPolicy",
    "RunSummary",
    "Runner",
    "enqueue_tasks",
    "sampling_seed",
    "summarize",
    "WrongHarness",
]
