"""The update receipt's schema: one document binding a candidate to its exact parent, data, evaluator,
attempts, span coverage, held-out and protected results, canary, rollback drill and approvals. Phase 1
(`Plan`) is frozen before training; phase 2 (`RolloutEvidence`) is columnar; phase 3 holds the rest.
Evidence that does not exist is `None` (or an empty list), never a healthy default.
"""

from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.functional_validators import AfterValidator

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.errors import InvalidInput, from_validation_error, subfield_error
from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.types import AttemptState, RetryKind, RolloutKind, RolloutStatus

RECEIPT_SCHEMA_VERSION = 1
# Larger files are refused before reading: a million rollouts in columnar form stay well below this.
MAX_JSON_BYTES = 256 * 2**20
# Algorithm settings nesting deeper are refused before validation, hashing or serialisation recurse.
MAX_DEPTH = 64

NonEmpty = Annotated[str, Field(min_length=1)]


def _normalized(value: str) -> str:
    """Ids and names that look alike must be equal strings: NFC, no invisible character (format, zero-width,
    control, separator but the space) and no surrounding whitespace."""
    if not value.isprintable() or value != value.strip() or not unicodedata.is_normalized("NFC", value):
        raise ValueError(
            f"{value!r} is not a normalized name (NFC, no invisible or surrounding blank characters)"
        )
    return value


Name = Annotated[NonEmpty, AfterValidator(_normalized)]  # an id or name: task, rollout, family, actor, ...
Count = Annotated[int, Field(ge=0)]
Share = Annotated[float, Field(ge=0.0, le=1.0)]


class _Model(BaseModel):
    # frozen: builders return new receipts; forbid: a misspelt field is an error, not dropped; no NaN/inf: a
    # NaN reward compares false with everything and would pass or fail by accident.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _check_json_finite(value: Any, path: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise subfield_error(path, f"non-finite number {value!r}")
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_json_finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json_finite(v, f"{path}.{i}" if path else str(i))


class SnapshotRef(_Model):
    snapshot_id: Name
    content_hash: Name
    n_tasks: Count | None = None
    # family -> planned tasks of that family; None: not declared (then only `n_tasks` is checked)
    families: dict[Name, Count] | None = None
    # the set's tasks, when the plan lists them (the canary runs only these); left out of the JSON when None
    task_ids: list[Name] | None = Field(default=None, exclude_if=lambda v: v is None)


class ParentRef(_Model):
    """The exact parent. `resolves`/`loads` are what was observed when the plan was made (None: not tried)."""

    resource_id: Name
    uri: Name
    weights_hash: str | None = None
    resolves: bool | None = None
    loads: bool | None = None
    model_version: Name | None = None  # the registry's version of the parent, when it is registered


class EvaluatorRef(_Model):
    name: Name
    version: Name


class ApproverRoles(_Model):
    """Roles allowed to approve each step; the policy names which of them are required."""

    canary: list[Name]
    default: list[Name]


class RetryBudget(_Model):
    """Retries declared up front (sample: the agent's method; infrastructure: broken workers, timeouts)."""

    expected_sample_retries: Count
    infrastructure_retries: Count


class Plan(_Model):
    candidate_id: Name
    parent: ParentRef
    train_snapshot: SnapshotRef
    holdout_snapshot: SnapshotRef
    protected_snapshot: SnapshotRef | None = None
    canary_snapshot: SnapshotRef | None = None
    evaluator: EvaluatorRef
    algorithm: dict[str, Any]
    code_revision: Name
    scope: NonEmpty
    approvers: ApproverRoles
    # rollout kind (train, holdout, protected, canary) -> span families each such rollout must produce
    expected_span_families: dict[RolloutKind, list[Name]]
    # rollout kind -> how many rollouts the plan asks for (tasks x group size); None: not declared
    expected_rollouts: dict[RolloutKind, Count] | None = None
    retry_budget: RetryBudget
    created_at: float | None = None

    @field_validator("algorithm")
    @classmethod
    def _algorithm_finite(cls, v: dict[str, Any]) -> dict[str, Any]:
        _check_json_finite(v)
        return v


class RolloutEvidence(_Model):
    """Columnar: rollout i has `span_counts[i][j]` spans of family `families[j]` (None: unreadable, not zero);
    attempt k is rollout `attempt_rollout[k]`'s."""

    rollout_ids: list[Name]
    kinds: list[RolloutKind]
    statuses: list[RolloutStatus]
    families: list[Name]
    span_counts: list[list[Count] | None]
    attempt_rollout: list[Count]
    attempt_endings: list[AttemptState]
    attempt_retry_kinds: list[RetryKind]
    attempt_reasons: list[str | None]

    @model_validator(mode="after")
    def _aligned(self) -> RolloutEvidence:
        n = len(self.rollout_ids)
        for name in ("kinds", "statuses", "span_counts"):
            if len(getattr(self, name)) != n:
                raise subfield_error(name, f"has {len(getattr(self, name))} entries for {n} rollouts")
        m = len(self.attempt_rollout)
        for name in ("attempt_endings", "attempt_retry_kinds", "attempt_reasons"):
            if len(getattr(self, name)) != m:
                raise subfield_error(name, f"has {len(getattr(self, name))} entries for {m} attempts")
        width = len(self.families)
        for i, row in enumerate(self.span_counts):
            if row is not None and len(row) != width:
                raise subfield_error(f"span_counts.{i}", f"has {len(row)} counts for {width} families")
        if m and max(self.attempt_rollout) >= n:
            bad = next(k for k, i in enumerate(self.attempt_rollout) if i >= n)
            raise subfield_error(
                f"attempt_rollout.{bad}", f"refers to rollout {self.attempt_rollout[bad]} of {n}"
            )
        return self

    @property
    def total_spans(self) -> int:
        return sum(sum(row) for row in self.span_counts if row is not None)


class ValidationEval(_Model):
    """One checkpoint judged greedily on the run's validation split."""

    step: Annotated[int, Field(ge=1)]
    success: Share
    lost: list[Name] = []  # validation cases the parent solved and this checkpoint did not


class TrainingRun(_Model):
    """Steps run against the plan, an early stop's reason and the validation the gate recomputes it from."""

    steps_planned: Annotated[int, Field(ge=1)]
    steps_run: Annotated[int, Field(ge=1)]
    early_stop: NonEmpty | None = None
    parent_validation_success: Share | None = None
    validation: list[ValidationEval] = []
    chosen_step: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _steps(self) -> TrainingRun:
        if self.steps_run > self.steps_planned:
            raise ValueError(f"steps_run {self.steps_run} exceeds steps_planned {self.steps_planned}")
        return self


class CandidateArtifact(_Model):
    resource_id: Name
    uri: Name
    weights_hash: str | None = None
    # the checkpoint's other files (tokenizer, chat template, configs: `checkpoints.files_hash`)
    files_hash: str | None = Field(default=None, exclude_if=lambda v: v is None)
    parent_id: Name
    model_version: Name | None = None  # the registry's version (e.g. "3"), when registered
    created_at: float | None = None  # when training produced it (unix seconds)
    # None: every planned step is expected. Left out of the JSON when None (as `files_hash`), so receipts
    # written before the field hash (and verify their signatures) as they did.
    training: TrainingRun | None = Field(default=None, exclude_if=lambda v: v is None)


class FamilyScore(_Model):
    """Mean rewards on one family (None: not evaluated); `distinct_tasks`: distinct ids behind `n`."""

    family: Name
    n: Count
    distinct_tasks: Count | None = None
    candidate_mean: Share | None
    parent_mean: Share | None


class HoldoutComparison(_Model):
    snapshot_id: Name
    parent_id: Name
    candidate_id: Name
    evaluator: EvaluatorRef
    seed: int | None = None
    families: list[FamilyScore]
    at: float | None = None  # when the comparison finished


class ProtectedFamily(_Model):
    """`regressed`: cases the parent passed and the candidate failed; `missing`: cases without a result."""

    family: Name
    n: Count
    # both required: an omitted list must not read as "no regressions"
    regressed: list[Name]
    missing: Count

    @model_validator(mode="after")
    def _fits(self) -> ProtectedFamily:
        if len(self.regressed) + self.missing > self.n:
            raise subfield_error(
                "n", f"{len(self.regressed)} regressed + {self.missing} missing exceed n={self.n}"
            )
        return self


class ProtectedResults(_Model):
    snapshot_id: Name | None = None
    parent_id: Name
    candidate_id: Name
    families: list[ProtectedFamily]
    at: float | None = None


class CanaryLimits(_Model):
    max_tasks: Count
    max_seconds: Annotated[float, Field(ge=0)]
    allowed_tools: list[Name]
    max_cost: Annotated[float, Field(ge=0)]
    allowed_side_effects: list[Name]  # destinations the canary may write to


class CanaryUsage(_Model):
    tasks: Count
    seconds: Annotated[float, Field(ge=0)]
    tools_used: list[Name]
    cost: Annotated[float, Field(ge=0)]
    side_effects: list[Name]


class CanaryTask(_Model):
    """`verified`: the destination was re-read and matched, else `evidence` names weaker evidence and
    `uncertainty` how unsure it is. `harmful_effect` None: no record either way."""

    task_id: Name
    destination: Name | None = None
    verified: bool
    evidence: str = ""
    uncertainty: Share | None = None
    harmful_effect: bool | None


class CanaryReport(_Model):
    serving_resource_id: Name
    limits: CanaryLimits
    usage: CanaryUsage | None
    tasks: list[CanaryTask]
    at: float | None = None  # when the canary finished
    # why check 6's effect check is unavailable (no `verify` hook); left out when None (old hashes hold)
    unverifiable: str | None = Field(default=None, exclude_if=lambda v: v is None)


class RollbackDrill(_Model):
    """The exact parent resolved, loaded and routed back to; None: not tried."""

    parent_id: Name
    environment: str = ""
    resolved: bool | None
    loaded: bool | None
    routed_back: bool | None
    at: float | None = None


class Approval(_Model):
    actor: Name
    role: Name
    step: Literal["canary", "default"]
    at: float
    # What the actor signed (`release.approvals`): the receipt's evidence hash then, and the signature.
    evidence_hash: str | None = None
    signature: str | None = None


class Fingerprints(_Model):
    """Fingerprints (see `hashing.fingerprint`) of what the evidence depended on, for staleness."""

    evaluator: str | None = None
    tool_contract: str | None = None
    task_distribution: str | None = None
    parent: str | None = None
    serving_model: str | None = None
    retry_policy: str | None = None
    permissions: str | None = None
    destinations: str | None = None


class GateRecord(_Model):
    """The gate's verdict as written into the receipt: which policy judged which evidence."""

    verdict: Literal["PROMOTE TO BOUNDED CANARY", "HOLD"]
    policy_version: NonEmpty
    policy_hash: NonEmpty
    receipt_hash: NonEmpty
    failed_checks: list[Check]
    unavailable_checks: list[Check]
    stale_checks: list[Check]


class Receipt(_Model):
    schema_version: Literal[1] = RECEIPT_SCHEMA_VERSION
    receipt_id: Name
    plan: Plan
    fingerprints: Fingerprints = Fingerprints()
    rollouts: RolloutEvidence | None = None
    candidate: CandidateArtifact | None = None
    holdout: HoldoutComparison | None = None
    protected: ProtectedResults | None = None
    canary: CanaryReport | None = None
    rollback_drill: RollbackDrill | None = None
    approvals: list[Approval] = []
    gate: GateRecord | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def receipt_hash(receipt: Receipt) -> str:
    """Content hash of the evidence: the whole receipt except the gate's own record of its verdict."""
    return content_hash(receipt.model_dump(mode="json", exclude={"gate"}))


def _too_deep(data: Any, limit: int) -> str | None:
    """The path of the first value nested deeper than `limit`, else None (iterative: any depth is safe)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > limit:
            return path
        # only containers nest: scalars (most of a columnar receipt) are not pushed
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack += [
            (v, f"{path}.{k}" if path else str(k), depth + 1) for k, v in items if isinstance(v, dict | list)
        ]
    return None


def parse_receipt(data: Any) -> Receipt:
    """Validate a JSON-shaped receipt; raises `InvalidInput` naming each bad field."""
    if not isinstance(data, dict):
        raise InvalidInput("receipt", [("", f"expected a JSON object, got {type(data).__name__}")])
    version = data.get("schema_version", RECEIPT_SCHEMA_VERSION)
    if version != RECEIPT_SCHEMA_VERSION:
        raise InvalidInput(
            "receipt",
            [("schema_version", f"receipt schema {version!r} is not supported (this gate reads 1)")],
        )
    # Only the free-form algorithm settings can nest without bound: typed fields refuse nesting at once.
    plan = data.get("plan")
    algorithm = plan.get("algorithm") if isinstance(plan, dict) else None
    if isinstance(algorithm, dict) and (deep := _too_deep(algorithm, MAX_DEPTH)) is not None:
        deep = f"plan.algorithm.{deep}"
        where = ".".join(deep.split(".")[:6])
        raise InvalidInput("receipt", [(where, f"nested too deeply (over {MAX_DEPTH} levels)")])
    try:
        # a receipt file's `attestation` (`gate.attestation`) is the pipeline's signature of it, not evidence
        return Receipt.model_validate({k: v for k, v in data.items() if k != "attestation"})
    except ValidationError as err:
        raise from_validation_error("receipt", err) from None


def read_json(path: str | Path, what: str) -> Any:
    """Read a JSON file; anything unreadable, oversized or malformed is `InvalidInput`."""
    limit = MAX_JSON_BYTES
    try:
        size = Path(path).stat().st_size
        if size > limit:
            raise InvalidInput(what, [("", f"{path} has {size} bytes, more than the limit of {limit}")])
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as err:
        raise InvalidInput(what, [("", f"cannot read {path}: {err.strerror}")]) from None
    except UnicodeDecodeError as err:
        raise InvalidInput(what, [("", f"not UTF-8 text: byte {err.start} cannot be decoded")]) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidInput(what, [("", f"not JSON: {err.msg} at line {err.lineno}")]) from None
    except RecursionError:
        raise InvalidInput(what, [("", "JSON nested too deeply")]) from None


def load_receipt(path: str | Path) -> Receipt:
    return parse_receipt(read_json(path, "receipt"))
