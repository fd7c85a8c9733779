"""The retry policy, declared before a run and recorded with it. It names *endings* (states like `timeout`,
reason codes like `no_reward`): `sample_retry_on` earns a sample retry, `retry_on` an infrastructure retry,
which waits `backoff_s * 2**(k-1)` seconds (at most `backoff_max_s`, also the longest claims pause)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from lightning_dagster.settings import UsageError
from lightning_dagster.types import Attempt, RetryKind


class InvalidPolicy(ValueError, UsageError):
    """A retry policy that cannot be applied (non-positive limits)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 3
    retry_on: tuple[str, ...] = ("failed", "timeout", "unresponsive")
    sample_retry_on: tuple[str, ...] = ()
    timeout_s: float = 60.0
    heartbeat_timeout_s: float = 30.0
    backoff_s: float = 0.5
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidPolicy(f"max_attempts must be >= 1, got {self.max_attempts}")
        # NaN passes every comparison below: a NaN or infinite timeout would never end an attempt.
        times = ("timeout_s", "heartbeat_timeout_s", "backoff_s", "backoff_max_s")
        unbounded = [
            f"{name}={getattr(self, name)}" for name in times if not math.isfinite(getattr(self, name))
        ]
        if unbounded:
            raise InvalidPolicy(f"times must be finite numbers of seconds, got {', '.join(unbounded)}")
        if self.timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise InvalidPolicy("timeout_s and heartbeat_timeout_s must be positive")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise InvalidPolicy(
                f"backoff needs 0 <= backoff_s <= backoff_max_s, got {self.backoff_s} and {self.backoff_max_s}"
            )
        # lists from JSON/YAML configs, kept hashable
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

    def delay_s(self, ended: Attempt, kind: RetryKind) -> float:
        """How long the retry of `ended` waits before any runner may claim it (sample retries: none)."""
        if kind is not RetryKind.infrastructure:
            return 0.0
        return min(self.backoff_max_s, self.backoff_s * 2 ** (ended.sequence_id - 1))

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
