"""The retry policy, declared before a run starts and recorded with it.

An attempt's *ending* is its final state (`failed`, `timeout`, ...) or its reason code (`killed`,
`no_reward`, ...); the policy names endings, so it can be as coarse or as precise as the harness needs.
An ending in `sample_retry_on` is an expected sample retry (part of the agent's method); one in `retry_on`
is an infrastructure retry (paid for a broken worker, gateway or timeout). The gate tells them apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from lightning_dagster.types import Attempt, RetryKind


class InvalidPolicy(ValueError):
    """A retry policy that cannot be applied (non-positive limits)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    retry_on: tuple[str, ...] = ("failed", "timeout", "unresponsive")
    sample_retry_on: tuple[str, ...] = ()
    timeout_s: float = 60.0
    heartbeat_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidPolicy(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise InvalidPolicy("timeout_s and heartbeat_timeout_s must be positive")
        # Accept lists from JSON/YAML configs but keep the policy hashable and immutable.
        object.__setattr__(self, "retry_on", tuple(self.retry_on))
        object.__setattr__(self, "sample_retry_on", tuple(self.sample_retry_on))

    @property
    def heartbeat_interval_s(self) -> float:
        """How often a live attempt heartbeats: several beats fit in one timeout window."""
        return min(self.heartbeat_timeout_s / 4, 5.0)

    def retry_kind(self, attempt: Attempt) -> RetryKind | None:
        """The kind of retry this ended attempt earns, or None when its rollout is final."""
        if attempt.sequence_id >= self.max_attempts:
            return None
        endings = {attempt.state.value, attempt.reason_code}
        if endings & set(self.sample_retry_on):
            return RetryKind.sample
        if endings & set(self.retry_on):
            return RetryKind.infrastructure
        return None

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
