"""The versioned gate policy: every threshold of the seven checks, from YAML or JSON. `Policy.hash` is the
sha256 of its canonical JSON (comments and key order do not change it); a policy named like a packaged one
(`default-v1`) must hash like it.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.errors import InvalidInput, from_validation_error
from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.gate.receipt_models import Count, Fingerprints, Name, Share

POLICY_SCHEMA_VERSION = 1
DEFAULT_POLICY = "default-v1"
POLICIES = resources.files("lightning_dagster.gate").joinpath("policies")  # the packaged ones

FingerprintName = Literal[tuple(Fingerprints.model_fields)]  # the names a receipt records


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, populate_by_name=True)


class PinnedPolicy(_Model):
    require_parent_weights_hash: bool
    require_candidate_weights_hash: bool


class CoveragePolicy(_Model):
    min_complete_share: Share


class RetryDebtPolicy(_Model):
    max_unexpected_retries: Count


class HoldoutPolicy(_Model):
    min_margin: float
    min_n: Count


class ProtectedPolicy(_Model):
    default_tolerance: Count
    tolerance: dict[Name, Count]


class CanaryPolicy(_Model):
    min_verified_share: Share
    # the most any canary may run: a receipt's own `canary.limits` above these fail check 6
    max_tasks: Count
    max_seconds: Annotated[float, Field(ge=0)]
    max_cost: Annotated[float, Field(ge=0)]


class ApprovalPolicy(_Model):
    required_roles: list[Name]


class ChecksPolicy(_Model):
    """One section per check: attributes are the checks' machine names, file keys their numbers 1..7."""

    pinned: PinnedPolicy = Field(alias=Check.pinned.section)
    span_coverage: CoveragePolicy = Field(alias=Check.span_coverage.section)
    retry_debt: RetryDebtPolicy = Field(alias=Check.retry_debt.section)
    heldout_margin: HoldoutPolicy = Field(alias=Check.heldout_margin.section)
    protected_cases: ProtectedPolicy = Field(alias=Check.protected_cases.section)
    canary_verified: CanaryPolicy = Field(alias=Check.canary_verified.section)
    rollback_and_approval: ApprovalPolicy = Field(alias=Check.rollback_and_approval.section)


class StalenessPolicy(_Model):
    required_fingerprints: list[FingerprintName]


class StopPolicy(_Model):
    max_coverage_drop: Share


class Policy(_Model):
    schema_version: Literal[1]
    version: Name
    checks: ChecksPolicy
    staleness: StalenessPolicy
    stop: StopPolicy

    # A plain property: a cached one would be carried over by `model_copy(update=...)` and go stale.
    @property
    def hash(self) -> str:
        return content_hash(self.model_dump(mode="json", by_alias=True))


def parse_policy(data: Any) -> Policy:
    """Validate policy data; `InvalidInput` names the field, or the version of a false packaged name."""
    policy = _validated(data)
    if (packaged := _packaged_hash(policy.version)) not in (None, policy.hash):
        why = f"names the packaged policy of hash {packaged}, not this one ({policy.hash}): rename it"
        raise InvalidInput("policy", [("version", why)])
    return policy


@cache
def _packaged_hash(version: str) -> str | None:
    if f"{version}.yaml" not in {p.name for p in POLICIES.iterdir()}:
        return None
    return _validated(yaml.safe_load(POLICIES.joinpath(f"{version}.yaml").read_text())).hash


def _validated(data: Any) -> Policy:
    if not isinstance(data, dict):
        raise InvalidInput("policy", [("", f"expected a mapping, got {type(data).__name__}")])
    version = data.get("schema_version")
    if version != POLICY_SCHEMA_VERSION:
        raise InvalidInput(
            "policy", [("schema_version", f"policy schema {version!r} is not supported (this gate reads 1)")]
        )
    checks = data.get("checks")
    if isinstance(checks, dict):
        # YAML reads `1:` as an int key; check ids are matched as strings.
        data = {**data, "checks": {str(k): v for k, v in checks.items()}}
        unknown = sorted(k for k in data["checks"] if k not in {c.section for c in Check})
        if unknown:
            raise InvalidInput(
                "policy", [(f"checks.{k}", "unknown check id (known ids are 1 to 7)") for k in unknown]
            )
    try:
        return Policy.model_validate(data)
    except ValidationError as err:
        raise from_validation_error("policy", err) from None


def load_policy(path: str | Path | None = None) -> Policy:
    """Load a policy file (YAML or JSON); `None` loads the packaged default."""
    if path is None:
        text = POLICIES.joinpath(f"{DEFAULT_POLICY}.yaml").read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise InvalidInput("policy", [("", f"cannot read {path}: {err.strerror}")]) from None
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        raise InvalidInput("policy", [("", f"not YAML/JSON: {err}")]) from None
    return parse_policy(data)
