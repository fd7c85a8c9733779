"""The `training` asset group: transitions of the first batch, and the candidate the trainer makes of them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.evidence import first_batch
from lightning_dagster.pipeline.report import mlflow_links
from lightning_dagster.pipeline.results import Markdown, StageResult, Table
from lightning_dagster.pipeline.serving import collect, rollout_service, spans_tokenizer
from lightning_dagster.pipeline.snapshots import load_manifest, snapshot_refs

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import SnapshotRef, TrainingRun
    from lightning_dagster.pipeline.run import Pipeline
    from lightning_dagster.pipeline.snapshots import Manifest, Split
    from lightning_dagster.runner.service import RolloutService
    from lightning_dagster.training.distributed import Group


def training_transitions(p: Pipeline, key: str) -> StageResult:
    """Merged rows and rollout-level advantages of the first batch, written to a file referenced by URI. A
    rollout with an invalid span is left out; too many fail the stage (`TooManyExcludedRollouts`)."""
    from lightning_dagster.engine.tokenizer_hash import tokenizer_fingerprint_of
    from lightning_dagster.pipeline.transitions_file import write_transitions
    from lightning_dagster.training.configs import step_settings
    from lightning_dagster.training.step import batch_transitions

    store = p.get_store()
    receipt = ctx.head_receipt(store, key)
    batch = collect(store, first_batch(store, key, receipt))
    rows, advantages, merge, excluded = batch_transitions(batch, step_settings(ctx.settings(p).training))
    parent_dir = ctx.registry(p).download(ctx.registered_version(receipt.plan.parent))
    tokenizer = tokenizer_fingerprint_of(spans_tokenizer(p, parent_dir))
    out = ctx.snapshot_dir(key) / "transitions.jsonl.gz"
    path = write_transitions(out, rows, advantages, tokenizer=tokenizer, excluded=excluded)
    stage = {
        "uri": path.as_uri(),
        "rows": len(rows),
        "tokenizer": tokenizer,
        "excluded_rollouts": len(excluded),
    }
    ctx.save_stage(store, key, "training_transitions", stage)
    metadata = {
        "transitions_uri": path.as_uri(),
        "rows": len(rows),
        "trained_tokens": sum(r.trained_tokens for r in rows),
        "tokenizer": tokenizer,
        "merge_rate": merge.get("merge_single_row_attempts", 0) / max(1, merge.get("merge_attempts", 0)),
        **merge,
        "excluded": Table(
            ["rollout", "span", "reason"], [[e.rollout_id, e.span_id, e.reason] for e in excluded]
        ),
        **{f"advantage_{k}": v for k, v in advantages.to_dict().items()},
    }
    return StageResult(metadata)


def inputs_ready(p: Pipeline, key: str) -> None:
    """What `candidate_resource` reads before it trains (`StageMissing` while an upstream never
    materialized; `CandidateRecorded` once the receipt has its candidate)."""
    store = p.get_store()
    receipt = ctx.head_receipt(store, key)
    if receipt.candidate is not None:
        raise ctx.CandidateRecorded(key, receipt.candidate.model_version)
    ctx.registered_version(receipt.plan.parent)
    load_manifest(p, key)
    ctx.load_stage(store, key, "training_transitions")


def candidate_resource(
    p: Pipeline,
    key: str,
    *,
    run_id: str = "",
    group: Group | None = None,
    log: Callable[[dict], None] | None = None,
) -> StageResult:
    """RL (`training.loop.train_rl`) from the exact parent (step 1 on `training_transitions`), registered."""
    from lightning_dagster.engine.tokenizer_hash import tokenizer_fingerprint_of
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.pipeline.transitions_file import load_transitions
    from lightning_dagster.training.loop import FirstBatch, draw_pools, train_rl

    inputs_ready(p, key)
    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    parent_version = ctx.registered_version(receipt.plan.parent)
    parent_dir = reg.download(parent_version)
    t, source = ctx.settings(p).training, ctx.harness_source(p)
    started = time.time()
    # read (and its tokenizer checked against the parent's) before the other ranks are sent anything
    uri = ctx.load_stage(store, key, "training_transitions")["uri"]
    transitions = load_transitions(uri, tokenizer=tokenizer_fingerprint_of(parent_dir))
    excluded = {"excluded": transitions.excluded} if transitions.excluded else {}
    first = {"merge_excluded_rollouts": len(transitions.excluded), **excluded}

    @contextmanager
    def serve() -> Iterator[RolloutService]:
        parent_id = receipt.plan.parent.resource_id
        with rollout_service(
            p, parent_dir, snapshot_key=key, harness=source.spec, resource_id=parent_id, serves_parent=False
        ) as service:
            # the loop gives train rollouts the key; its validation rollouts carry none (its own evidence)
            yield service.service

    result = train_rl(
        parent_dir,
        t,
        draw_pools(source.dataset, t, train=manifest.splits.train, holdout=False),
        serve,
        base_seed=manifest.base_seed,
        first=FirstBatch(transitions.rows, transitions.advantages, first),
        tag=key,
        snapshot_key=key,
        candidate_id=receipt.plan.candidate_id,
        out_dir=ctx.candidate_dir(key),
        log=log,
        group=group,
    )
    curve, selection, out = result.steps, result.selection, result.checkpoint
    assert out is not None
    refs, plan = snapshot_refs(manifest), receipt.plan
    evaluator = f"{plan.evaluator.name}@{plan.evaluator.version}"
    # the selection as parameters, its per-checkpoint lists as metrics; numbers only per step
    params = {k: v for k, v in selection.items() if k != "checkpoints"}
    version = reg.log_candidate(
        out,
        parent_version=parent_version,
        snapshot_key=key,
        algorithm_config={**plan.algorithm, "selection": params},
        metrics_per_step=[{k: float(v) for k, v in m.items() if type(v) in (int, float)} for m in curve],
        train_snapshot=_dataset(manifest, key, "train", refs["train"]),
        heldout_snapshot=_dataset(manifest, key, "holdout", refs["holdout"]),
        receipt_id=receipt.receipt_id,
        started_at=started,
        ended_at=time.time(),
        code_revision=plan.code_revision,
        evaluator_version=evaluator,
        orchestrator_run_id=run_id,
    )
    stage = {"checkpoint": str(out), "version": version.version, "run_id": version.run_id}
    ctx.save_stage(store, key, "candidate_resource", stage | {"selection": selection})
    artifact = R.CandidateArtifact(
        resource_id=plan.candidate_id,
        uri=version.model_uri,
        weights_hash=version.weights_hash,
        files_hash=version.files_hash or None,
        parent_id=plan.parent.resource_id,
        model_version=version.version,
        training=training_run(selection, t.steps),
    )
    receipt = R.set_fingerprints(R.add_candidate(receipt, artifact), serving_model=version.weights_hash)
    stored = ctx.append_receipt(store, key, receipt)
    metadata = {
        "checkpoint_uri": out.as_uri(),
        "weights_hash": version.weights_hash,
        "model_version": version.model_uri,
        "parent": plan.parent.uri,
        "snapshot": key,
        "evaluator": evaluator,
        "steps": len(curve),
        "kl_coef": t.kl_coef,
        "validation_tasks": selection["validation_tasks"],
        "chosen_step": selection["chosen_step"],
        "kept_parent_cases": str(selection.get("kept_parent_cases")),
        "early_stop": selection["early_stop"] or "",
        "final_reward": round(float(curve[-1].get("success", 0.0)), 4),
        "final_loss": round(float(curve[-1].get("loss", 0.0)), 6),
        # 0: no step had a learning signal (every group's rewards were equal, so every advantage was 0)
        "trained_rows": sum(int(point.get("trained_rows", 0)) for point in curve),
        "curves": Markdown(curve_table(curve)),
        "receipt_version": stored.version,
        **mlflow_links(reg, version.run_id, version.version),
    }
    return StageResult(metadata, data_version=version.weights_hash)


def training_run(selection: dict[str, Any], steps_planned: int) -> TrainingRun:
    """The receipt's record of how training ran (`TrainingRun`)."""
    from lightning_dagster.gate import receipt as R

    return R.TrainingRun(
        steps_planned=steps_planned,
        steps_run=selection["steps_run"],
        early_stop=selection["early_stop"] or None,
        parent_validation_success=selection.get("parent_validation_success"),
        validation=[
            R.ValidationEval(step=c["step"], success=c["success"], lost=list(c["lost"]))
            for c in selection.get("checkpoints", [])
        ],
        chosen_step=selection["chosen_step"],
    )


def _dataset(manifest: Manifest, key: str, split: Split, ref: SnapshotRef) -> dict[str, Any]:
    """One frozen split as the registry logs it: an MLflow dataset input of the candidate's run."""
    return {
        "name": f"{key}/{split}",
        "content_hash": ref.content_hash,
        "rows": ref.n_tasks,
        "records": getattr(manifest.splits, split),
        "uri": Path(manifest.dataset.path).as_uri() if manifest.dataset else "",
    }


def curve_table(curve: list[dict[str, Any]]) -> str:
    """Sampled success, loss and validation figures per RL step: a table the UI renders."""

    def validation(m: dict[str, Any]) -> str:
        if "validation_success" not in m:
            return " | "
        return f"{float(m['validation_success']):.4f} | {int(m['validation_lost_parent_cases'])}"

    rows = [
        f"| {step} | {float(m.get('success', 0.0)):.4f} | {float(m.get('loss', 0.0)):.6f} | {validation(m)} |"
        for step, m in enumerate(curve, start=1)
    ]
    head = "| step | reward (sampled success) | loss | validation success | parent cases lost |\n"
    return head + "|---|---|---|---|---|\n" + "\n".join(rows)
