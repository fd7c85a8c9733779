"""Stale evidence: which of the seven checks a changed fingerprint voids (`VOIDS`). A fingerprint is compared
only when a current value is given: if it differs from the recorded one, or the receipt never recorded it, its
checks are void. One the policy requires but the receipt lacks voids its checks even with no current values
(freshness cannot be shown later).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.errors import InvalidInput
from lightning_dagster.gate.receipt_models import Fingerprints

# fingerprint -> the checks a change voids, and why
VOIDS: dict[str, tuple[Check, ...]] = {
    # held-out and protected scores came from the old evaluator
    "evaluator": (Check.heldout_margin, Check.protected_cases),
    # expected span families, scores and the canary all assumed the old tools
    "tool_contract": (
        Check.span_coverage,
        Check.heldout_margin,
        Check.protected_cases,
        Check.canary_verified,
    ),
    # the held-out and protected cases drawn now are not the ones judged
    "task_distribution": (Check.heldout_margin, Check.protected_cases),
    # pinning, the comparison against the parent and the rollback target
    "parent": (Check.pinned, Check.heldout_margin, Check.rollback_and_approval),
    "serving_model": (Check.canary_verified,),  # an earlier canary does not cover a new serving model
    # retry debt is counted against the old policy; the canary ran under it
    "retry_policy": (Check.retry_debt, Check.canary_verified),
    "permissions": (Check.canary_verified,),  # an earlier canary does not cover a new permission
    "destinations": (Check.canary_verified,),  # an earlier canary does not cover a new destination
}


def void_checks(
    recorded: Fingerprints,
    current: Fingerprints | Mapping[str, str | None] | None = None,
    *,
    required: Iterable[str] = (),
) -> dict[Check, list[str]]:
    """Map each void check to the reasons it is void (empty mapping: nothing stale)."""
    cur = current.model_dump() if isinstance(current, Fingerprints) else dict(current or {})
    unknown = sorted(set(cur) - set(VOIDS))
    if unknown:
        raise InvalidInput("fingerprints", [(name, "unknown fingerprint") for name in unknown])
    rec = recorded.model_dump()
    reasons: dict[Check, list[str]] = {}

    def void(name: str, why: str) -> None:
        for check in VOIDS[name]:
            reasons.setdefault(check, []).append(f"{name} {why}")

    for name in VOIDS:
        was, now = rec.get(name), cur.get(name)
        if was is None and (name in required or now is not None):
            void(name, "was not recorded in the receipt")
        elif now is not None and now != was:
            void(name, "changed since the receipt was made")
    return dict(sorted(reasons.items()))


def changed_settings(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, list[str]]:
    """The changed settings behind each fingerprint, e.g. `{"evaluator": ["holdout_tasks: 128 -> 64"]}`."""
    out: dict[str, list[str]] = {}
    for name in sorted(set(recorded) & set(current)):
        was, now = recorded[name], current[name]
        if was == now:
            continue
        if isinstance(was, Mapping) and isinstance(now, Mapping):
            out[name] = [
                f"{field}: {_short(was.get(field))} -> {_short(now.get(field))}"
                for field in sorted(set(was) | set(now))
                if was.get(field) != now.get(field)
            ]
        else:
            out[name] = [f"{_short(was)} -> {_short(now)}"]
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = "(unset)" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
