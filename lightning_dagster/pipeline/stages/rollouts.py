"""The `rollouts` asset group: the first batch sampled from the exact parent, and the spans it recorded."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.evidence import first_batch, with_rollout_evidence
from lightning_dagster.pipeline.results import StageResult
from lightning_dagster.pipeline.serving import rollout_service
from lightning_dagster.pipeline.snapshots import load_manifest

if TYPE_CHECKING:
    from lightning_dagster.pipeline.run import Pipeline


def rollouts(p: Pipeline, key: str) -> StageResult:
    """The first batch: every train task of step 1 x group size, sampled from the exact parent."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.runner.summary import failure_lines
    from lightning_dagster.training.configs import step_settings
    from lightning_dagster.training.step import sample_step

    store, receipt, manifest = p.get_store(), ctx.head_receipt(p.get_store(), key), load_manifest(p, key)
    parent = receipt.plan.parent
    parent_dir = ctx.registry(p).download(ctx.registered_version(parent))
    t, harness = ctx.settings(p).training, ctx.harness_source(p).spec
    with rollout_service(
        p, parent_dir, snapshot_key=key, harness=harness, resource_id=parent.resource_id, serves_parent=True
    ) as service:
        tasks, settings, seed = (
            manifest.splits.train[: t.tasks_per_step],
            step_settings(t),
            manifest.base_seed,
        )
        batch = sample_step(
            service.service,
            tasks,
            step=1,
            settings=settings,
            base_seed=seed,
            tag=f"{key}-s1",
            snapshot_key=key,
        )
    attempts = store.list_attempts(rollout_ids=[r.rollout_id for r in batch.rollouts])
    evidence = R.rollout_evidence(batch.rollouts, attempts, None)  # span counts belong to `spans`
    endings = dict(Counter(ending.value for ending in evidence.attempt_endings))
    retries = sum(1 for k in evidence.attempt_retry_kinds if k.value != "first")
    n = len(batch.rollouts)
    metadata = {
        "rollouts": n,
        "attempts": len(attempts),
        "attempts_by_ending": endings,
        "retries": retries,
        "rewarded": len(batch.rewards),
        "reward_mean": batch.success(),
        "seconds": round(batch.seconds, 2),
        "rollouts_per_s": round(n / batch.seconds, 2) if batch.seconds else None,
        **({"failures": failure_lines(batch.failures)} if batch.failures else {}),  # a line per reason
    }
    return StageResult(metadata)


def spans(p: Pipeline, key: str) -> StageResult:
    store = p.get_store()
    receipt = ctx.head_receipt(store, key)
    # Phase 2 goes into the ledger once, at `release_receipt`, rebuilt from the store over every rollout.
    ev = with_rollout_evidence(store, receipt, first_batch(store, key, receipt)).rollouts
    expected = receipt.plan.expected_span_families
    column = {f: j for j, f in enumerate(ev.families)}
    complete = sum(
        1
        for kind, row in zip(ev.kinds, ev.span_counts, strict=True)
        if row is not None and all(row[column[f]] for f in expected.get(kind, []))
    )
    per_family = {f: sum(row[j] for row in ev.span_counts if row is not None) for f, j in column.items()}
    metadata = {
        "spans": ev.total_spans,
        "spans_by_family": per_family,
        "rollouts_with_expected_spans": complete,
        "coverage": round(complete / len(ev.rollout_ids), 4) if ev.rollout_ids else None,
    }
    return StageResult(metadata)
