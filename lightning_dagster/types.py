"""The shared data model: every record the store keeps and the gateway, runner, trainer and gate exchange.
The attempt state machine is an explicit table of allowed moves, enforced by `check_transition`.
"""

from __future__ import annotations

import enum
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def new_id(prefix: str) -> str:
    """A sortable-enough unique id with a readable prefix (`ro-…`, `at-…`, `sp-…`)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def now() -> float:
    return time.time()


class RolloutKind(str, enum.Enum):
    train = "train"
    holdout = "holdout"
    protected = "protected"
    canary = "canary"
    serve = "serve"
    # a trainer's greedy check of its checkpoints on train-split tasks it does not train on
    # (training.selection); never part of a snapshot's planned rollouts
    validation = "validation"


class RolloutStatus(str, enum.Enum):
    """A rollout's status follows its latest attempt; `failed` only once retries are exhausted."""

    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class AttemptState(str, enum.Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    timeout = "timeout"
    unresponsive = "unresponsive"
    cancelled = "cancelled"


TERMINAL_ATTEMPT_STATES = frozenset(AttemptState) - {AttemptState.queued, AttemptState.running}

# The whole attempt state machine: a running attempt may end in any terminal state, which has no way out.
ALLOWED_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.queued: frozenset({AttemptState.running, AttemptState.cancelled}),
    AttemptState.running: TERMINAL_ATTEMPT_STATES,
    **{s: frozenset() for s in TERMINAL_ATTEMPT_STATES},
}


class IllegalTransition(ValueError):
    """An attempt was asked to move along an edge the state machine does not have."""

    def __init__(self, attempt_id: str, current: AttemptState, target: AttemptState):
        super().__init__(f"attempt {attempt_id}: illegal transition {current.value} -> {target.value}")
        self.attempt_id, self.current, self.target = attempt_id, current, target


def check_transition(attempt_id: str, current: AttemptState, target: AttemptState) -> None:
    if target not in ALLOWED_TRANSITIONS[current]:
        raise IllegalTransition(attempt_id, current, target)


class RetryKind(str, enum.Enum):
    """Why an attempt exists beyond the first: an expected sample retry is part of the agent's method
    (declared in the retry policy); an infrastructure retry pays for a broken worker, gateway or timeout."""

    first = "first"
    sample = "sample"
    infrastructure = "infrastructure"


class Record(BaseModel):
    """A stored record. Its JSON-mode dump keeps NaN and infinities as they are (pydantic's default turns them
    into null, which would store a different value than the one given): the store refuses them, naming the
    field, on every backend alike."""

    model_config = ConfigDict(ser_json_inf_nan="constants")


class Resource(Record):
    """A versioned model or prompt resource. `parent_id` is the exact resource it was derived from."""

    resource_id: str = Field(default_factory=lambda: new_id("res"))
    kind: Literal["model", "prompt"] = "model"
    uri: str  # a directory holding a Hugging Face format checkpoint, or a prompt file
    parent_id: str | None = None
    weights_hash: str | None = None  # sha256 over the checkpoint's files, see engine.checkpoint_hash
    created_at: float = Field(default_factory=now)
    metadata: dict[str, Any] = Field(default_factory=dict)


class Sampling(BaseModel):
    """The sampling of every LLM call of one rollout (`metadata["sampling"]`), applied by the gateway
    whatever the harness asks for and recorded on each LLM span. Temperature 0 is greedy."""

    model_config = {"extra": "forbid", "frozen": True}

    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)  # None: what the harness asks for (capped by the backend)


class Rollout(Record):
    rollout_id: str = Field(default_factory=lambda: new_id("ro"))
    kind: RolloutKind = RolloutKind.train
    task_id: str = ""
    task: dict[str, Any] = Field(default_factory=dict)  # the input handed to the harness
    snapshot_key: str | None = None
    group_id: str | None = None  # rollouts of one task sampled together (GRPO group)
    resource_id: str | None = None  # the resource that serves this rollout
    harness: str | None = None
    status: RolloutStatus = RolloutStatus.queued
    created_at: float = Field(default_factory=now)
    metadata: dict[str, Any] = Field(default_factory=dict)

    def sampling(self) -> Sampling | None:
        """The sampling decided for this rollout (`metadata["sampling"]`), or None: the harness decides."""
        raw = self.metadata.get("sampling")
        return Sampling.model_validate(raw) if raw is not None else None


class Attempt(Record):
    attempt_id: str = Field(default_factory=lambda: new_id("at"))
    rollout_id: str
    sequence_id: int = 1  # 1 for the first attempt of a rollout, 2 for its first retry, ...
    state: AttemptState = AttemptState.queued
    retry_kind: RetryKind = RetryKind.first
    reason_code: str | None = None  # e.g. "exit_nonzero", "killed", "timeout", "no_heartbeat", "ok"
    reason_message: str | None = None
    worker_id: str | None = None
    heartbeat_at: float | None = None
    started_at: float | None = None
    ended_at: float | None = None


class SpanKind(str, enum.Enum):
    llm = "llm"
    tool = "tool"
    reward = "reward"
    custom = "custom"


class Span(Record):
    """OpenTelemetry-shaped. LLM spans also fill the token fields, stored compactly."""

    span_id: str = Field(default_factory=lambda: new_id("sp"))
    trace_id: str = ""  # by convention the attempt id
    parent_span_id: str | None = None
    rollout_id: str
    attempt_id: str
    sequence: int = 0  # order of the span within its attempt, assigned by the recorder
    name: str = ""
    kind: SpanKind = SpanKind.custom
    start_time: float = Field(default_factory=now)
    end_time: float | None = None
    status: Literal["ok", "error", "unset"] = "ok"
    attributes: dict[str, Any] = Field(default_factory=dict)
    # LLM spans only
    prompt_token_ids: list[int] | None = None
    response_token_ids: list[int] | None = None
    response_logprobs: list[float] | None = None
    finish_reason: str | None = None
    resource_id: str | None = None


def span_family(kind: str, name: str, attributes: dict[str, Any] | None = None) -> str:
    """The family a span counts toward for coverage: its `family` attribute if set, else its name for custom
    spans (e.g. the runner's `effect`), else its kind (`llm`, `tool`, `reward`)."""
    if family := (attributes or {}).get("family"):
        return str(family)
    return name if kind == SpanKind.custom.value else kind


class Reward(Record):
    rollout_id: str
    attempt_id: str | None = None
    value: float
    judge: str = "harness"
    judge_version: str = "1"
    uncertainty: float | None = None
    created_at: float = Field(default_factory=now)
