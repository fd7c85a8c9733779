"""What a run did, read back from the store (the durable truth), not from the runner's memory."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning_dagster.runner.harness_spec import HarnessSpec
from lightning_dagster.runner.retry import RetryPolicy
from lightning_dagster.store import Store
from lightning_dagster.types import Attempt, AttemptState, RetryKind, SpanKind, span_family


@dataclass
class RunSummary:
    harness: str
    mode: str
    rollouts: int
    rollouts_by_status: dict[str, int]
    attempts: int
    attempts_by_ending: dict[str, int]  # final attempt states
    reasons: dict[str, int]  # reason codes of ended attempts
    retries_by_kind: dict[str, int]  # attempts beyond the first: sample vs infrastructure
    spans: int
    llm_spans: int
    span_coverage: float | None  # share of succeeded rollouts whose final attempt has every expected family
    rewards: int  # succeeded rollouts whose final attempt posted a reward
    reward_mean: float | None  # over those rewards; None when there are none (never a made-up 0)
    missing_rewards: int  # succeeded rollouts whose final attempt posted no reward
    token_in_share: float | None  # share of follow-up LLM calls that extended the previous call exactly
    effects: dict[str, int] | None  # harnesses with a verifier: verified / effect_ok / harmful attempts
    wall_s: float
    rollouts_per_s: float
    policy: dict[str, Any]
    # reason -> rollouts with an attempt that ended so, an example's message and that attempt's files
    failures: dict[str, dict[str, Any]] = field(default_factory=dict)
    rollout_ids: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


EXAMPLE_CHARS = 500  # of a failure's example message


def _example(attempt: Attempt, error: str | None, folder: Path | None) -> str:
    """What went wrong: a refused call's error, else the last stderr line, else the reason's first line."""
    if error:
        return error
    stderr = folder / "stderr" if folder is not None else None
    text = stderr.read_text(errors="replace") if stderr is not None and stderr.is_file() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else (attempt.reason_message or "").strip().split("\n")[0])[:EXAMPLE_CHARS]


def failures(attempts: list[Attempt], spans: list, workdir: Path | None) -> dict[str, dict[str, Any]]:
    """Per failure reason: how many rollouts had an attempt end so, one's message and folder (or None)."""
    errors = {s.attempt_id: s.attributes["error"] for s in spans if "error" in s.attributes}
    rollouts: dict[str, set[str]] = {}
    out: dict[str, dict[str, Any]] = {}
    for a in attempts:
        if a.state in (AttemptState.succeeded, AttemptState.cancelled) or not a.reason_code:
            continue
        rollouts.setdefault(a.reason_code, set()).add(a.rollout_id)
        if a.reason_code not in out:
            folder = workdir / a.rollout_id / a.attempt_id if workdir is not None else None
            folder = folder if folder is not None and folder.is_dir() else None
            example = _example(a, errors.get(a.attempt_id), folder)
            out[a.reason_code] = {"example": example, "dir": str(folder) if folder else None}
    return {reason: {"rollouts": len(rollouts[reason]), **found} for reason, found in out.items()}


def failure_lines(found: dict[str, dict[str, Any]]) -> list[str]:
    return [
        f"failed: {reason} in {f['rollouts']} rollout(s), e.g. {f['example']!r}"
        + (f" (files: {f['dir']})" if f.get("dir") else "")
        for reason, f in found.items()
    ]


def summarize(
    store: Store,
    rollout_ids: list[str],
    harness: HarnessSpec,
    *,
    policy: RetryPolicy,
    wall_s: float,
    mode: str,
    workdir: Path | None = None,
) -> RunSummary:
    rollouts = store.query_rollouts(rollout_ids=rollout_ids) if rollout_ids else []
    attempts = store.list_attempts(rollout_ids=rollout_ids) if rollout_ids else []
    spans = store.list_spans(rollout_ids=rollout_ids) if rollout_ids else []
    rewards = store.list_rewards(rollout_ids=rollout_ids) if rollout_ids else []
    final = {a.rollout_id: a for a in sorted(attempts, key=lambda a: a.sequence_id)}  # the latest of each

    families: dict[str, set[str]] = {}
    llm_by_attempt: dict[str, list] = {}
    effects = Counter()
    for span in spans:
        families.setdefault(span.attempt_id, set()).add(
            span_family(span.kind.value, span.name, span.attributes)
        )
        if span.kind == SpanKind.llm:
            llm_by_attempt.setdefault(span.attempt_id, []).append(span)
        if span.kind == SpanKind.custom and span.name == "effect":
            effects["attempts"] += 1
            effects["verified"] += bool(span.attributes.get("verified"))
            effects["effect_ok"] += bool(span.attributes.get("effect_ok"))
            effects["harmful"] += bool(span.attributes.get("harmful_effect"))

    # The first call of an attempt has nothing to extend; the share is over the follow-up calls.
    follow_ups = [s for calls in llm_by_attempt.values() for s in calls[1:]]
    extended = sum(1 for s in follow_ups if s.attributes.get("token_in") is True)

    succeeded = [a for a in final.values() if a.state == AttemptState.succeeded]
    reward_of = {r.attempt_id: r.value for r in rewards}
    final_rewards = [reward_of[a.attempt_id] for a in succeeded if a.attempt_id in reward_of]
    expected = set(harness.expected_span_families)
    covered = sum(1 for a in succeeded if expected <= families.get(a.attempt_id, set()))

    return RunSummary(
        harness=harness.name,
        mode=mode,
        rollouts=len(rollouts),
        rollouts_by_status=dict(Counter(r.status.value for r in rollouts)),
        attempts=len(attempts),
        attempts_by_ending=dict(Counter(a.state.value for a in attempts)),
        reasons=dict(Counter(a.reason_code for a in attempts if a.reason_code)),
        retries_by_kind=dict(
            Counter(a.retry_kind.value for a in attempts if a.retry_kind != RetryKind.first)
        ),
        spans=len(spans),
        llm_spans=sum(len(calls) for calls in llm_by_attempt.values()),
        span_coverage=covered / len(succeeded) if succeeded else None,
        rewards=len(final_rewards),
        reward_mean=sum(final_rewards) / len(final_rewards) if final_rewards else None,
        missing_rewards=len(succeeded) - len(final_rewards),
        token_in_share=extended / len(follow_ups) if follow_ups else None,
        effects=dict(effects) if harness.verify is not None else None,
        wall_s=round(wall_s, 3),
        rollouts_per_s=round(len(rollouts) / wall_s, 3) if wall_s > 0 else 0.0,
        policy=policy.to_dict(),
        failures=failures(attempts, spans, workdir),
        rollout_ids=list(rollout_ids),
    )
