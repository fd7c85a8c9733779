"""The `snapshot` asset group: the frozen task sets, and receipt phase 1 (the update plan)."""

from __future__ import annotations

import importlib.metadata
import time
from typing import TYPE_CHECKING, Any

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.report import family_table
from lightning_dagster.pipeline.results import Markdown, StageResult, Table
from lightning_dagster.pipeline.snapshots import freeze_tasks, load_manifest, snapshot_refs
from lightning_dagster.pipeline.versions import code_version
from lightning_dagster.settings import trainer_threads
from lightning_dagster.types import RolloutKind

if TYPE_CHECKING:
    from lightning_dagster.gate.ledger import LedgerEntry
    from lightning_dagster.gate.policy import Policy
    from lightning_dagster.gate.receipt import Plan, Receipt
    from lightning_dagster.pipeline.run import Pipeline


PREVIEW_ROWS = 5  # train tasks shown in the `tasks` asset's preview table


def tasks(p: Pipeline, key: str, cut: dict[str, Any] | None = None) -> StageResult:
    manifest = freeze_tasks(p, key, cut)
    splits, dataset = dict(manifest.splits), manifest.dataset
    project: dict[str, Any] = {}
    if dataset is not None:
        project = {
            "project": dataset.project,
            "harness_kind": dataset.harness_kind,
            "dataset": dataset.path,
            "dataset_hash": dataset.content_hash,
            "dataset_rows": family_counts(dataset.rows),
        }
    metadata = {
        "snapshot": key,
        "content_hash": manifest.content_hash,
        "harness": manifest.harness,
        **project,
        **{f"{split}_tasks": len(items) for split, items in splits.items()},
        "serve_rollouts": len(manifest.serve_rollout_ids),
        "families": Markdown(family_table(splits)),
        "preview": preview(manifest.splits.train[:PREVIEW_ROWS]),
    }
    return StageResult(metadata, data_version=manifest.content_hash)


def family_counts(rows: dict[str, dict[str, int]]) -> Table:
    """Rows per family (one row each) and split (one column each), with a total row."""
    families = sorted({family for counts in rows.values() for family in counts})
    body = [[family, *(rows[split].get(family, 0) for split in rows)] for family in families]
    total = ["(all)", *(sum(rows[split].values()) for split in rows)]
    return Table(columns=["family", *rows], rows=[*body, total])


def preview(items: list[dict[str, Any]]) -> Table:
    """The given tasks with every column any of them has, in first-seen order."""
    columns = list(dict.fromkeys(column for task in items for column in task))
    return Table(columns=columns, rows=[[task.get(column) for column in columns] for task in items])


def update_plan(p: Pipeline, key: str) -> StageResult:
    """Receipt phase 1, with the parent resolved (bytes verified) and loaded right now."""
    from lightning_dagster.engine import Engine
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.registry.core import APPROVED

    store, reg, manifest = p.get_store(), ctx.registry(p), load_manifest(p, key)
    if (existing := ctx.find_receipt(store, key)) is not None:
        # Phase 1 is frozen: re-materializing reports the plan already in the ledger, it never re-plans.
        return _plan_result(p, existing, ctx.append_receipt(store, key, existing))
    parent = reg.resolve(APPROVED)  # raises PointerNotSet: never "whatever is latest"
    settings = ctx.settings(p)
    t, gate = settings.training, settings.gate
    Engine(parent.local_path, threads=settings.serving.engine_threads)  # loadable, not just resolvable
    parent_uri = f"models:/{p.mlflow.model_name}/{parent.version}"
    refs = snapshot_refs(manifest)
    source = ctx.harness_source(p)
    spec = source.spec  # the canary's too: it runs the pipeline's own project
    plan = R.Plan(
        candidate_id=ctx.candidate_id(key),
        parent=R.ParentRef(
            resource_id=parent_uri,
            uri=parent_uri,
            weights_hash=parent.weights_hash,
            resolves=True,
            loads=True,
            model_version=parent.version,
        ),
        **{f"{split}_snapshot": ref for split, ref in refs.items()},  # train, holdout, protected, canary
        evaluator=R.EvaluatorRef(name=gate.evaluator, version=gate.evaluator_version),
        algorithm=algorithm(p, source.name),
        code_revision=code_version("training", "runner", "gateway", "engine"),
        scope=gate.scope,
        approvers=R.ApproverRoles(canary=gate.canary_approver_roles, default=gate.default_approver_roles),
        expected_span_families={
            kind: list(spec.expected_span_families)
            for kind in (RolloutKind.train, RolloutKind.holdout, RolloutKind.protected, RolloutKind.canary)
        },
        # What the stages will run on what was frozen (a dataset may hold fewer closed tasks than asked):
        # each train task x group, parent and candidate once on each closed task, the candidate on the canary.
        expected_rollouts={
            RolloutKind.train: len(manifest.splits.train) * t.group_size,
            RolloutKind.holdout: 2 * len(manifest.splits.holdout),
            RolloutKind.protected: 2 * len(manifest.splits.protected),
            RolloutKind.canary: min(len(manifest.splits.canary), t.canary_tasks),
        },
        retry_budget=R.RetryBudget(
            expected_sample_retries=0, infrastructure_retries=gate.infrastructure_retry_budget
        ),
        created_at=time.time(),
    )
    inputs = ctx.fingerprint_inputs(p)
    ctx.save_stage(store, key, ctx.FINGERPRINT_INPUTS, dict(inputs))
    fingerprints = ctx.global_fingerprints(p, parent.weights_hash, inputs)
    receipt = R.from_plan(plan, receipt_id=ctx.receipt_id(key), fingerprints=R.Fingerprints(**fingerprints))
    return _plan_result(p, receipt, ctx.append_receipt(store, key, receipt))


def policy_shortfalls(plan: Plan, policy: Policy) -> list[str]:
    """Why a plan cannot pass the policy that will judge it, whatever the candidate does (empty: none)."""
    out = []
    holdout, min_n = plan.holdout_snapshot.n_tasks or 0, policy.checks.heldout_margin.min_n
    if holdout < min_n:
        out.append(
            f"check 4 needs at least {min_n} held-out tasks (policy {policy.version}); the plan has "
            f"{holdout}: raise TrainingResource.holdout_tasks or judge with a policy made for small plans"
        )
    # Not declared (None) is not "none planned": only a declared zero cannot pass.
    canary = (plan.expected_rollouts or {}).get(RolloutKind.canary)
    if canary == 0 and policy.checks.canary_verified.min_verified_share > 0:
        out.append("check 6 needs a verified canary; the plan runs no canary task (canary_tasks 0)")
    missing = sorted(set(policy.checks.rollback_and_approval.required_roles) - set(plan.approvers.canary))
    if missing:
        out.append(f"check 7 needs approval by {', '.join(missing)}, a role the plan's canary approvers lack")
    return out


def _plan_result(p: Pipeline, receipt: Receipt, stored: LedgerEntry) -> StageResult:
    plan, pol = receipt.plan, ctx.policy(p)
    shortfalls = policy_shortfalls(plan, pol)
    warning = "\n".join(f"- {s}" for s in shortfalls)
    metadata = {
        "policy": pol.version,
        "plan_can_pass": not shortfalls,
        "cannot_pass": Markdown(f"**This plan cannot pass policy {pol.version}:**\n\n{warning}")
        if shortfalls
        else "none: every check can pass on the evidence",
        "receipt_id": receipt.receipt_id,
        "receipt_version": stored.version,
        "candidate_id": plan.candidate_id,
        "parent": plan.parent.uri,
        "parent_weights_hash": plan.parent.weights_hash,
        "evaluator": f"{plan.evaluator.name}@{plan.evaluator.version}",
        "train_snapshot": plan.train_snapshot.content_hash,
        "holdout_snapshot": plan.holdout_snapshot.content_hash,
        "scope": plan.scope,
        "approvers": plan.approvers.model_dump(),
        "expected_rollouts": {k.value: v for k, v in (plan.expected_rollouts or {}).items()},
        "algorithm": plan.algorithm,
    }
    return StageResult(metadata, data_version=stored.content_hash)


def algorithm(p: Pipeline, harness: str) -> dict[str, Any]:
    """The recipe, and what a rerun needs to reproduce it (`reproduce`: the seeds, the thread settings,
    the torch build; the tasks and the sampling seed are the snapshot's)."""
    settings = ctx.settings(p)
    t = settings.training
    return {
        "name": t.advantage,
        "steps": t.steps,
        "tasks_per_step": t.tasks_per_step,
        "group_size": t.group_size,
        "learning_rate": t.learning_rate,
        "temperature": t.temperature,
        "loss_normalization": t.loss_normalization,
        "loss_constant": t.loss_constant,
        "kl_coef": t.kl_coef,
        "validation_tasks": t.validation_tasks,
        "validation_every": t.validation_every,
        "validation_patience": t.validation_patience,
        "harness": harness,
        "reproduce": {
            "seed": t.seed,
            "eval_seed": t.eval_seed,
            "trainer_threads": trainer_threads(t.nproc),
            "engine_threads": settings.serving.engine_threads,
            "device": t.device,
            "torch": importlib.metadata.version("torch"),
        },
    }
