"""The `training` asset group: transitions of the first batch, and the candidate the trainer makes of them."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.evidence import first_batch
from lightning_dagster.pipeline.report import mlflow_links
from lightning_dagster.pipeline.results import Markdown, StageResult
from lightning_dagster.pipeline.serving import collect, rollout_service, step_settings, trainer_config
from lightning_dagster.pipeline.snapshots import load_manifest, snapshot_refs

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import SnapshotRef
    from lightning_dagster.pipeline.settings import Pipeline
    from lightning_dagster.pipeline.snapshots import Manifest, Split


def training_transitions(p: Pipeline, key: str) -> StageResult:
    """Merged rows and rollout-level advantages of the first batch, written to a file referenced by URI."""
    from lightning_dagster.pipeline.transitions_file import write_transitions
    from lightning_dagster.training.loop import batch_transitions

    store = p.get_store()
    batch = collect(store, first_batch(store, key, ctx.head_receipt(store, key)))
    rows, advantages, merge = batch_transitions(batch, step_settings(p))
    path = write_transitions(ctx.snapshot_dir(key) / "transitions.jsonl.gz", rows, advantages)
    ctx.save_stage(store, key, "training_transitions", {"uri": path.as_uri(), "rows": len(rows)})
    return StageResult(
        metadata={
            "transitions_uri": path.as_uri(),
            "rows": len(rows),
            "trained_tokens": sum(r.trained_tokens for r in rows),
            "merge_rate": merge.get("merge_single_row_attempts", 0) / max(1, merge.get("merge_attempts", 0)),
            **{k: v for k, v in merge.items()},
            **{f"advantage_{k}": v for k, v in advantages.to_dict().items()},
        }
    )


def candidate_resource(p: Pipeline, key: str, *, run_id: str = "") -> StageResult:
    """Step 1 trains on `training_transitions`; steps 2.. sample on-policy from the updated weights through
    the same gateway and runner (recorded in the store like the first batch), as GRPO needs fresh samples."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.gate import receipt_hash
    from lightning_dagster.pipeline.transitions_file import read_transitions
    from lightning_dagster.training.loop import rl_step
    from lightning_dagster.training.trainer import Trainer

    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    candidate_id = receipt.plan.candidate_id
    parent_version = ctx.registered_version(receipt.plan.parent)
    parent_dir = reg.download(parent_version)
    t = p.training
    trainer = Trainer(parent_dir, trainer_config(p))
    rows, advantages = read_transitions(ctx.load_stage(store, key, "training_transitions")["uri"])
    curve = [trainer.step(rows, advantages)]
    if t.steps > 1:
        with rollout_service(
            p,
            parent_dir,
            snapshot_key=key,
            harness=ctx.harness_source(p).spec,
            resource_id=f"{candidate_id}@1",
            serves_parent=False,
        ) as service:
            service.load_weights(trainer.state_dict(), f"{candidate_id}@1")
            for step in range(2, t.steps + 1):
                _, m = rl_step(
                    service.service,
                    trainer,
                    manifest.splits.train[(step - 1) * t.tasks_per_step : step * t.tasks_per_step],
                    step=step,
                    settings=step_settings(p),
                    base_seed=manifest.base_seed,
                    tag=f"{key}-s{step}",
                    resource_id=f"{candidate_id}@{step}",
                    snapshot_key=key,
                )
                curve.append(m)
    out = trainer.save(ctx.candidate_dir(key))
    refs = snapshot_refs(manifest)
    version = reg.log_candidate(
        out,
        parent_version=parent_version,
        snapshot_key=key,
        algorithm_config=receipt.plan.algorithm,
        metrics_per_step=[_numeric(m) for m in curve],
        train_snapshot=_dataset(manifest, key, "train", refs["train"]),
        heldout_snapshot=_dataset(manifest, key, "holdout", refs["holdout"]),
        receipt_id=receipt.receipt_id,
        receipt_hash=receipt_hash(receipt),
        code_revision=receipt.plan.code_revision,
        evaluator_version=f"{receipt.plan.evaluator.name}@{receipt.plan.evaluator.version}",
        orchestrator_run_id=run_id,
    )
    ctx.save_stage(
        store,
        key,
        "candidate_resource",
        {"checkpoint": str(out), "version": version.version, "run_id": version.run_id},
    )
    receipt = R.add_candidate(
        receipt,
        R.CandidateArtifact(
            resource_id=candidate_id,
            uri=version.model_uri,
            weights_hash=version.weights_hash,
            parent_id=receipt.plan.parent.resource_id,
            model_version=version.version,
        ),
    )
    receipt = R.set_fingerprints(receipt, serving_model=version.weights_hash)
    stored = ctx.append_receipt(store, key, receipt)
    return StageResult(
        metadata={
            "checkpoint_uri": out.as_uri(),
            "weights_hash": version.weights_hash,
            "model_version": version.model_uri,
            "parent": receipt.plan.parent.uri,
            "snapshot": key,
            "evaluator": f"{receipt.plan.evaluator.name}@{receipt.plan.evaluator.version}",
            "steps": len(curve),
            "final_reward": round(float(curve[-1].get("success", 0.0)), 4),
            "final_loss": round(float(curve[-1].get("loss", 0.0)), 6),
            "curves": Markdown(curve_table(curve)),
            "receipt_version": stored.version,
            **mlflow_links(p, reg, version.run_id, version.version),
        },
        data_version=version.weights_hash,
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
    """Sampled success (the reward curve) and loss per RL step, one row each: a table the UI renders."""
    rows = [
        f"| {step} | {float(m.get('success', 0.0)):.4f} | {float(m.get('loss', 0.0)):.6f} |"
        for step, m in enumerate(curve, start=1)
    ]
    return "| step | reward (sampled success) | loss |\n|---|---|---|\n" + "\n".join(rows)


def _numeric(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
