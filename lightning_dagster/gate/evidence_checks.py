"""Checks 1 to 3, on what training used and produced: pinned identity, span coverage and retry debt."""

from __future__ import annotations

from collections import Counter

from lightning_dagster.gate.check_ids import Check
from lightning_dagster.gate.findings import CheckResult, Findings, rounded
from lightning_dagster.gate.policy import Policy
from lightning_dagster.gate.receipt_models import Receipt
from lightning_dagster.gate.stage_table import (
    NO_CAUSES,
    ROLLOUTS,
    STAGES,
    TRAINING,
    Causes,
    EarlyStop,
    early_stop,
    first_batch_size,
    not_run,
    ran,
)
from lightning_dagster.types import AttemptState, RetryKind, RolloutKind, RolloutStatus

# Identifiers that name a moving target rather than an exact version.
UNPINNED = frozenset({"", "latest", "head", "main", "master", "current", "*"})


def check_pinned(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """The candidate resource, the exact parent (resolves and loads), the snapshots and the evaluator."""
    p, plan, cfg = r.plan.parent, r.plan, policy.checks.pinned
    f = Findings()
    f.tri(p.resolves, f"parent {p.resource_id}", "does not resolve", "was not checked to resolve")
    f.tri(p.loads, f"parent {p.resource_id}", "does not load", "was not checked to load")
    if cfg.require_parent_weights_hash and not p.weights_hash:
        f.miss("parent weights hash not recorded")
    c = r.candidate
    if c is None:
        f.miss(not_run(TRAINING, causes, "candidate artifact not recorded"))
    else:
        if c.resource_id != plan.candidate_id:
            f.fail(f"candidate artifact {c.resource_id} is not the planned candidate {plan.candidate_id}")
        if c.parent_id != p.resource_id:
            f.fail(f"candidate was derived from {c.parent_id}, not the planned parent {p.resource_id}")
        if cfg.require_candidate_weights_hash and not c.weights_hash:
            f.miss("candidate weights hash not recorded")
    pins = {
        "train snapshot": plan.train_snapshot.snapshot_id,
        "train snapshot hash": plan.train_snapshot.content_hash,
        "held-out snapshot": plan.holdout_snapshot.snapshot_id,
        "held-out snapshot hash": plan.holdout_snapshot.content_hash,
        "evaluator version": plan.evaluator.version,
        "code revision": plan.code_revision,
    }
    for what, value in pins.items():
        if value.strip().lower() in UNPINNED:
            f.fail(f"{what} {value!r} is not pinned")
    figures = {
        "candidate_id": plan.candidate_id,
        "candidate_weights_hash": c.weights_hash if c else None,
        "parent_id": p.resource_id,
        "parent_uri": p.uri,
        "parent_weights_hash": p.weights_hash,
        "parent_resolves": p.resolves,
        "parent_loads": p.loads,
        "train_snapshot": plan.train_snapshot.snapshot_id,
        "holdout_snapshot": plan.holdout_snapshot.snapshot_id,
        "evaluator": f"{plan.evaluator.name}@{plan.evaluator.version}",
        "code_revision": plan.code_revision,
    }
    return f.result(
        Check.pinned, "candidate, exact parent (resolves, loads), snapshots and evaluator pinned", figures
    )


def expected_of_stages_that_ran(
    r: Receipt, causes: Causes, stop: EarlyStop | None
) -> tuple[dict[RolloutKind, int], dict[str, dict]]:
    """Per kind, the rollouts expected of the stages that ran (before training, the first batch; after a
    justified early `stop`, the steps run); per stage that did not, those it would have started and why."""
    expected = dict(r.plan.expected_rollouts or {})
    skipped: dict[str, dict] = {}
    for stage in STAGES:
        if ran(r, stage.name):
            if stage.name == TRAINING and stop is not None and stop.problem is None and stop.not_started:
                kind = RolloutKind.train
                expected[kind] = max(0, expected.get(kind, 0) - stop.not_started)
                skipped[stage.name] = {"rollouts": {kind.value: stop.not_started}, "why": stop.why}
            continue
        for kind in stage.kinds:
            if kind not in expected:
                continue
            keep = 0
            if stage.name == TRAINING:
                batch = first_batch_size(r)
                keep = expected[kind] if batch is None else min(batch, expected[kind])
            elif kind is RolloutKind.train:
                continue  # the first batch's train rollouts are judged with training's
            if expected[kind] > keep:
                entry = skipped.setdefault(
                    stage.name, {"rollouts": {}, "why": causes.get(stage.name, "has not run")}
                )
                entry["rollouts"][kind.value] = expected[kind] - keep
                expected[kind] = keep
    return expected, skipped


def _never_started(skipped: dict[str, dict]) -> str:
    parts = []
    for name, entry in skipped.items():
        counts = ", ".join(f"{n} {kind}" for kind, n in entry["rollouts"].items())
        why = entry["why"]
        if why != "has not run" and not why.startswith("stopped early"):
            why = f"did not run: {why}"
        parts.append(f"{counts} expected rollouts never started ({name} {why})")
    return "; ".join(parts)


def check_span_coverage(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """Every rollout the plan expects of the stages that ran has a span of each expected family."""
    ev, f = r.rollouts, Findings()
    need = policy.checks.span_coverage.min_complete_share
    if ev is None:
        f.miss(not_run(ROLLOUTS, causes, "no rollout evidence recorded"))
        return f.result(Check.span_coverage, "", {"min_complete_share": need})
    column = {fam: j for j, fam in enumerate(ev.families)}
    expected = r.plan.expected_span_families
    # per kind: the column of each expected family (-1: no span of that family was seen at all)
    required: dict[RolloutKind, list[tuple[str, int]] | None] = {
        kind: None if kind not in expected else [(fam, column.get(fam, -1)) for fam in expected[kind]]
        for kind in set(ev.kinds)
    }
    complete = unknown = incomplete = unfinished = 0
    missing_by_family: Counter[str] = Counter()
    succeeded = RolloutStatus.succeeded
    for kind, status, row in zip(ev.kinds, ev.statuses, ev.span_counts, strict=True):
        if status is not succeeded:
            unfinished += 1
            continue
        req = required[kind]
        if req is None or row is None:
            unknown += 1
            continue
        gaps = [fam for fam, j in req if j < 0 or row[j] == 0]
        if gaps:
            incomplete += 1
            missing_by_family.update(gaps)
        else:
            complete += 1
    recorded = Counter(ev.kinds)
    stop = early_stop(r)
    expected, skipped = expected_of_stages_that_ran(r, causes, stop)
    planned = sum(max(recorded[k], expected.get(k, 0)) for k in recorded.keys() | expected.keys())
    never_recorded = planned - len(ev.kinds)
    undeclared = sorted(k.value for k, req in required.items() if req is None)
    figures = {
        "planned": planned,
        "recorded": len(ev.kinds),
        "never_recorded": never_recorded,
        "unfinished": unfinished,
        "finished_incomplete": incomplete,
        "unknown": unknown,
        "complete": complete,
        "complete_share": rounded(complete / planned) if planned else None,
        "min_complete_share": need,
        "missing_by_family": dict(sorted(missing_by_family.items())),
        "spans": ev.total_spans,
        "never_started": skipped,
    }
    if planned == 0:
        f.miss("no rollouts planned or recorded")
        return f.result(Check.span_coverage, "", figures)
    summary = f"{complete} of {planned} rollouts complete (need share {need})"
    if skipped:
        summary += f"; {_never_started(skipped)}"
    if stop is not None and stop.problem is not None:
        figures["early_stop_refused"] = stop.problem
        summary += f"; training's early stop not accepted ({stop.problem}), so every planned step is expected"
    if (complete + unknown) / planned < need:
        f.fail(
            f"{summary}: {unfinished} unfinished, {incomplete} finished without every expected span"
            f" family, {never_recorded} never recorded"
        )
    elif complete / planned < need:
        if undeclared:
            f.miss(f"the plan declares no expected span families for kinds {undeclared}")
        f.miss(f"{summary}: coverage of {unknown} finished rollouts is unknown")
    return f.result(Check.span_coverage, summary, figures)


def check_retry_debt(r: Receipt, policy: Policy, causes: Causes = NO_CAUSES) -> CheckResult:
    """Retries beyond the plan's budgets, plus unclassified ones (a second `first` attempt), are debt."""
    ev, f = r.rollouts, Findings()
    limit = policy.checks.retry_debt.max_unexpected_retries
    budget = r.plan.retry_budget
    if ev is None:
        f.miss(not_run(ROLLOUTS, causes, "no rollout evidence recorded"))
        return f.result(Check.retry_debt, "", {"max_unexpected_retries": limit})
    kinds = Counter(ev.attempt_retry_kinds)
    first_rollouts = {
        i for i, k in zip(ev.attempt_rollout, ev.attempt_retry_kinds, strict=True) if k is RetryKind.first
    }
    unclassified = kinds[RetryKind.first] - len(first_rollouts)
    sample, infra = kinds[RetryKind.sample], kinds[RetryKind.infrastructure]
    excess_sample = max(0, sample - budget.expected_sample_retries)
    excess_infra = max(0, infra - budget.infrastructure_retries)
    unexpected = excess_sample + excess_infra + unclassified
    retried_reasons = Counter(
        reason or "unknown"
        for reason, ending in zip(ev.attempt_reasons, ev.attempt_endings, strict=True)
        if ending is not AttemptState.succeeded
    )
    figures = {
        "attempts": len(ev.attempt_rollout),
        "sample_retries": sample,
        "infrastructure_retries": infra,
        "unclassified_retries": unclassified,
        "budget_sample_retries": budget.expected_sample_retries,
        "budget_infrastructure_retries": budget.infrastructure_retries,
        "unexpected_retries": unexpected,
        "max_unexpected_retries": limit,
        "endings": {
            k.value: v for k, v in sorted(Counter(ev.attempt_endings).items(), key=lambda kv: kv[0].value)
        },
        "unsuccessful_reasons": dict(retried_reasons.most_common(10)),
    }
    if not ev.attempt_rollout and ev.rollout_ids:
        f.miss(f"no attempts recorded for {len(ev.rollout_ids)} rollouts")
    elif unexpected > limit:
        f.fail(
            f"{unexpected} unexpected retries (limit {limit}): {excess_sample} sample retries over budget,"
            f" {excess_infra} infrastructure retries over budget, {unclassified} unclassified"
        )
    return f.result(Check.retry_debt, f"retry debt {unexpected} within limit {limit}", figures)
