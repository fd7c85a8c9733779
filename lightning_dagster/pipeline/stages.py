"""One function per asset: the calls into store, runner, trainer, gate and registry that each asset makes.

Stages hand results to each other through the store (append-only documents, the receipt ledger), never
through Dagster's IO managers, so the same functions run under `dg.materialize`, `dagster dev`, the demo
and the benchmark. Each returns a `StageResult` (the metadata a user looks at). Heavy imports (torch, MLflow)
happen inside the functions: loading the code location stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.context import StageMissing
from lightning_dagster.pipeline.report import family_table, markdown_checks, mlflow_links
from lightning_dagster.pipeline.results import CheckOutcome, Markdown, StageResult
from lightning_dagster.pipeline.snapshots import freeze_tasks, load_manifest, snapshot_refs
from lightning_dagster.types import RolloutKind

# The graph's stages in materialization order, one asset each (assets/ wires them; the orchestration
# benchmark calls them directly in this order).
ASSET_STAGES = (
    "tasks",
    "update_plan",
    "rollouts",
    "spans",
    "training_transitions",
    "candidate_resource",
    "holdout_evaluation",
    "canary_results",
    "rollback_drill",
    "release_receipt",
)

__all__ = ["ASSET_STAGES", "StageMissing", *ASSET_STAGES, "judge", "approve", "promote", "rollback"]


# ---------------------------------------------------------------- snapshot and plan


def tasks(p: Any, key: str) -> StageResult:
    manifest = freeze_tasks(p, key)
    counts = {split: len(items) for split, items in manifest["splits"].items()}
    return StageResult(
        metadata={
            "snapshot": key,
            "content_hash": manifest["content_hash"],
            "harness": manifest["harness"],
            **{f"{split}_tasks": n for split, n in counts.items()},
            "serve_rollouts": len(manifest.get("serve_rollout_ids", [])),
            "families": Markdown(family_table(manifest["splits"])),
        },
        data_version=manifest["content_hash"],
    )


def update_plan(p: Any, key: str) -> StageResult:
    """Receipt phase 1, with the parent resolved (bytes verified) and loaded right now."""
    from lightning_dagster.engine import Engine
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.registry.core import APPROVED

    store, reg, manifest = p.get_store(), ctx.registry(p), load_manifest(p, key)
    existing = ctx.find_receipt(store, key)
    if existing is not None:
        # Phase 1 is frozen: re-materializing reports the plan already in the ledger, it never re-plans.
        return _plan_result(existing, ctx.append_receipt(store, existing))
    parent = reg.resolve(APPROVED)  # raises PointerNotSet: never "whatever is latest"
    Engine(parent.local_path, threads=p.model.engine_threads)  # loadable, not just resolvable
    parent_ref = f"models:/{p.mlflow.model_name}/{parent.version}"
    refs = snapshot_refs(manifest)
    spec = ctx.harness(p.model.harness)
    canary_spec = ctx.harness(ctx.canary_harness(p))
    t = p.training
    plan = R.Plan(
        candidate_id=ctx.candidate_id(key),
        parent=R.ParentRef(
            resource_id=parent_ref,
            uri=parent_ref,
            weights_hash=parent.weights_hash,
            resolves=True,
            loads=True,
        ),
        train_snapshot=refs["train"],
        holdout_snapshot=refs["holdout"],
        protected_snapshot=refs["protected"],
        canary_snapshot=refs["canary"],
        evaluator=R.EvaluatorRef(name=p.gate.evaluator, version=p.gate.evaluator_version),
        algorithm=algorithm(p),
        code_revision=ctx.code_version("training", "runner", "gateway", "engine"),
        scope=p.gate.scope,
        approvers=R.ApproverRoles(canary=p.gate.canary_approver_roles, default=p.gate.default_approver_roles),
        expected_span_families={
            RolloutKind.train: list(spec.expected_span_families),
            RolloutKind.holdout: list(spec.expected_span_families),
            RolloutKind.protected: list(spec.expected_span_families),
            RolloutKind.canary: list(canary_spec.expected_span_families),
        },
        expected_rollouts={
            RolloutKind.train: t.steps * t.tasks_per_step * t.group_size,
            RolloutKind.holdout: 2 * t.holdout_tasks,
            RolloutKind.protected: 2 * t.protected_tasks,
            RolloutKind.canary: t.canary_tasks,
        },
        retry_budget=R.RetryBudget(
            expected_sample_retries=0, infrastructure_retries=p.gate.infrastructure_retry_budget
        ),
        created_at=time.time(),
    )
    fingerprints = ctx.global_fingerprints(p, parent.weights_hash)
    receipt = R.from_plan(plan, receipt_id=ctx.receipt_id(key), fingerprints=R.Fingerprints(**fingerprints))
    return _plan_result(receipt, ctx.append_receipt(store, receipt))


def _plan_result(receipt: Any, stored: Any) -> StageResult:
    plan = receipt.plan
    return StageResult(
        metadata={
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
        },
        data_version=stored.content_hash,
    )


def algorithm(p: Any) -> dict[str, Any]:
    t = p.training
    return {
        "name": t.advantage,
        "steps": t.steps,
        "tasks_per_step": t.tasks_per_step,
        "group_size": t.group_size,
        "learning_rate": t.learning_rate,
        "temperature": t.temperature,
        "harness": p.model.harness,
    }


# ---------------------------------------------------------------- rollouts, spans, transitions


def rollouts(p: Any, key: str) -> StageResult:
    """The first batch: every train task of step 1 x group size, sampled from the exact parent."""
    from lightning_dagster.training.loop import RolloutService

    store, receipt, manifest = p.get_store(), ctx.head_receipt(p.get_store(), key), load_manifest(p, key)
    parent_dir = ctx.registry(p).download(_version(receipt.plan.parent.uri))
    t = p.training
    with RolloutService(
        store,
        parent_dir,
        harness=p.model.harness,
        resource_id=receipt.plan.parent.resource_id,
        parallel=p.gateway.parallel,
    ) as service:
        batch = service.run(
            manifest["splits"]["train"][: t.tasks_per_step],
            group=t.group_size,
            kind=RolloutKind.train,
            temperature=t.temperature,
            seed=_train_seed(manifest, 1),
            tag=f"{key}-s1",
        )
    ids = [r.rollout_id for r in batch.rollouts]
    ctx.save_stage(store, key, "rollouts", {"rollout_ids": ids, "seconds": batch.seconds})
    from lightning_dagster.gate import receipt as R

    attempts = store.list_attempts(rollout_ids=ids)
    evidence = R.rollout_evidence(batch.rollouts, attempts, None)  # span counts belong to `spans`
    endings: dict[str, int] = {}
    for ending in evidence.attempt_endings:
        endings[ending.value] = endings.get(ending.value, 0) + 1
    retries = sum(1 for k in evidence.attempt_retry_kinds if k.value != "first")
    return StageResult(
        metadata={
            "rollouts": len(ids),
            "attempts": len(attempts),
            "attempts_by_ending": endings,
            "retries": retries,
            "rewarded": len(batch.rewards),
            "reward_mean": batch.success(),
            "seconds": round(batch.seconds, 2),
            "rollouts_per_s": round(len(ids) / batch.seconds, 2) if batch.seconds else None,
        }
    )


def _version(model_uri: str) -> str:
    return model_uri.rsplit("/", 1)[-1]


def _train_seed(manifest: dict, step: int) -> int:
    # One sampling seed per (snapshot, step): a re-materialization re-samples exactly the same rollouts.
    return int(manifest["content_hash"].split(":")[-1][:6], 16) * 1000 + step * 100_000


def _snapshot_rollout_ids(store: Any, key: str) -> list[str]:
    """Every rollout the snapshot's stages ran (first batch, later RL steps, evaluation, canary)."""
    ids: list[str] = []
    for stage in ("rollouts", "candidate_resource", "holdout_evaluation", "canary_results"):
        try:
            ids.extend(ctx.load_stage(store, key, stage).get("rollout_ids", []))
        except StageMissing:
            continue
    return ids


def collect_rollout_evidence(store: Any, receipt: Any, rollout_ids: list[str]) -> Any:
    """Phase 2 straight from the store: rollouts, every attempt, spans counted per family."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.types import span_family

    found = store.query_rollouts(rollout_ids=rollout_ids) if rollout_ids else []
    attempts = store.list_attempts(rollout_ids=rollout_ids) if rollout_ids else []
    pairs = (
        (s.rollout_id, span_family(s.kind.value, s.name, s.attributes))
        for s in (store.list_spans(rollout_ids=rollout_ids) if rollout_ids else [])
    )
    return R.add_rollout_evidence(receipt, found, attempts, pairs)


def spans(p: Any, key: str) -> StageResult:
    store = p.get_store()
    receipt = ctx.head_receipt(store, key)
    ids = ctx.load_stage(store, key, "rollouts")["rollout_ids"]
    # Phase 2 goes into the ledger once, at `release_receipt`, rebuilt from the store over every rollout.
    ev = collect_rollout_evidence(store, receipt, ids).rollouts
    expected = receipt.plan.expected_span_families
    column = {f: j for j, f in enumerate(ev.families)}
    complete = sum(
        1
        for kind, row in zip(ev.kinds, ev.span_counts, strict=True)
        if row is not None and all(row[column[f]] for f in expected.get(kind, []))
    )
    per_family = {f: sum(row[j] for row in ev.span_counts if row is not None) for f, j in column.items()}
    return StageResult(
        metadata={
            "spans": ev.total_spans,
            "spans_by_family": per_family,
            "rollouts_with_expected_spans": complete,
            "coverage": round(complete / len(ev.rollout_ids), 4) if ev.rollout_ids else None,
        }
    )


def training_transitions(p: Any, key: str) -> StageResult:
    """Merged rows and rollout-level advantages of the first batch, written to a file referenced by URI."""
    from lightning_dagster.pipeline.transitions_file import write_transitions
    from lightning_dagster.training.advantages import compute_advantages
    from lightning_dagster.training.loop import RolloutService, rows_and_rewards
    from lightning_dagster.training.transitions import TransitionConfig

    store = p.get_store()
    ids = ctx.load_stage(store, key, "rollouts")["rollout_ids"]
    batch = RolloutService._collect(_Collector(store), store.query_rollouts(rollout_ids=ids), 0.0)
    rows, rewards, merge = rows_and_rewards(batch, TransitionConfig())
    advantages = compute_advantages(rewards, p.training.advantage)
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


class _Collector:
    """`RolloutService._collect` reads only `self.store`: re-use it to gather a finished batch from the store
    instead of keeping a second copy of the 'final successful attempt' rule here."""

    def __init__(self, store: Any) -> None:
        self.store = store


# ---------------------------------------------------------------- training


def candidate_resource(p: Any, key: str, *, run_id: str = "") -> StageResult:
    """Step 1 trains on `training_transitions`; steps 2.. sample on-policy from the updated weights through
    the same gateway and runner (recorded in the store like the first batch), as GRPO needs fresh samples."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.gate import receipt_hash
    from lightning_dagster.pipeline.transitions_file import read_transitions
    from lightning_dagster.training.advantages import compute_advantages
    from lightning_dagster.training.loop import RolloutService, rows_and_rewards
    from lightning_dagster.training.trainer import Trainer, TrainerConfig
    from lightning_dagster.training.transitions import TransitionConfig

    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    parent_version = _version(receipt.plan.parent.uri)
    parent_dir = reg.download(parent_version)
    t = p.training
    trainer = Trainer(parent_dir, TrainerConfig(lr=t.learning_rate, temperature=t.temperature))
    rows, advantages = read_transitions(ctx.load_stage(store, key, "training_transitions")["uri"])
    curve = [trainer.step(rows, advantages)]
    later: list[str] = []
    if t.steps > 1:
        with RolloutService(
            store,
            parent_dir,
            harness=p.model.harness,
            resource_id=f"{receipt.plan.candidate_id}@1",
            parallel=p.gateway.parallel,
            serving="process",  # its own interpreter lock: ~1.3x faster steps (training.loop)
        ) as service:
            service.load_weights(trainer.state_dict(), f"{receipt.plan.candidate_id}@1")
            for step in range(2, t.steps + 1):
                batch = service.run(
                    manifest["splits"]["train"][(step - 1) * t.tasks_per_step : step * t.tasks_per_step],
                    group=t.group_size,
                    kind=RolloutKind.train,
                    temperature=t.temperature,
                    seed=_train_seed(manifest, step),
                    tag=f"{key}-s{step}",
                )
                later.extend(r.rollout_id for r in batch.rollouts)
                step_rows, rewards, merge = rows_and_rewards(batch, TransitionConfig())
                m = trainer.step(step_rows, compute_advantages(rewards, t.advantage), extra=merge)
                curve.append({**m, "reward_mean": batch.success()})
                service.load_weights(trainer.state_dict(), f"{receipt.plan.candidate_id}@{step}")
    out = trainer.save(ctx.candidate_dir(key))
    refs = snapshot_refs(manifest)
    version = reg.log_candidate(
        out,
        parent_version=parent_version,
        snapshot_key=key,
        algorithm_config=receipt.plan.algorithm,
        metrics_per_step=[_numeric(m) for m in curve],
        train_snapshot={
            "name": f"{key}/train",
            "content_hash": refs["train"].content_hash,
            "rows": refs["train"].n_tasks,
        },
        heldout_snapshot={
            "name": f"{key}/holdout",
            "content_hash": refs["holdout"].content_hash,
            "rows": refs["holdout"].n_tasks,
        },
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
        {"rollout_ids": later, "checkpoint": str(out), "version": version.version, "run_id": version.run_id},
    )
    receipt = R.add_candidate(
        receipt,
        R.CandidateArtifact(
            resource_id=receipt.plan.candidate_id,
            uri=version.model_uri,
            weights_hash=version.weights_hash,
            parent_id=receipt.plan.parent.resource_id,
            model_version=version.model_uri,
        ),
    )
    receipt = R.set_fingerprints(receipt, serving_model=version.weights_hash)
    stored = ctx.append_receipt(store, receipt)
    return StageResult(
        metadata={
            "checkpoint_uri": out.as_uri(),
            "weights_hash": version.weights_hash,
            "model_version": version.model_uri,
            "parent": receipt.plan.parent.uri,
            "snapshot": key,
            "evaluator": f"{receipt.plan.evaluator.name}@{receipt.plan.evaluator.version}",
            "steps": len(curve),
            "reward_curve": [round(float(m.get("reward_mean", 0.0)), 4) for m in curve],
            "loss_curve": [round(float(m.get("loss", 0.0)), 6) for m in curve],
            "receipt_version": stored.version,
            **mlflow_links(p, reg, version.run_id, version.version),
        },
        data_version=version.weights_hash,
    )


def _numeric(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}


# ---------------------------------------------------------------- evaluation, canary, rollback


def holdout_evaluation(p: Any, key: str) -> StageResult:
    """Parent and candidate on the same held-out and protected tasks with the same sampling seeds."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.training.loop import RolloutService
    from lightning_dagster.training.trainer import load_model

    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    plan, t = receipt.plan, p.training
    if receipt.candidate is None:
        raise StageMissing(key, "candidate_resource")
    parent_dir = reg.download(_version(plan.parent.uri))
    candidate_dir = reg.download(_version(receipt.candidate.uri))
    holdout, protected = manifest["splits"]["holdout"], manifest["splits"]["protected"]
    scores: dict[str, dict[str, dict[str, float]]] = {}
    ids: list[str] = []
    with RolloutService(
        store,
        parent_dir,
        harness=p.model.harness,
        resource_id=plan.parent.resource_id,
        parallel=p.gateway.parallel,
    ) as service:
        for side, model_dir, resource in (
            ("parent", None, plan.parent.resource_id),
            ("candidate", candidate_dir, plan.candidate_id),
        ):
            if model_dir is not None:
                service.load_weights(load_model(model_dir).state_dict(), resource)
            # Held-out success is sampled at T=1.0 (RL's effect shows there); protected cases are decoded
            # greedily, so "the parent passed and the candidate failed" is a regression, not sampling noise.
            for kind, items, temperature in (
                (RolloutKind.holdout, holdout, 1.0),
                (RolloutKind.protected, protected, 0.0),
            ):
                batch = service.run(
                    items,
                    group=1,
                    kind=kind,
                    temperature=temperature,
                    seed=t.eval_seed,
                    tag=f"{key}-{side}-{kind.value}",
                )
                ids.extend(r.rollout_id for r in batch.rollouts)
                by_task = {r.task_id: batch.rewards.get(r.rollout_id) for r in batch.rollouts}
                scores.setdefault(side, {})[kind.value] = by_task
    ctx.save_stage(store, key, "holdout_evaluation", {"rollout_ids": ids, "scores": scores})
    families = {task["task_id"]: task["family"] for task in holdout + protected}

    def per_family(side: str) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for task_id, reward in scores[side]["holdout"].items():
            # A rollout that never posted a reward scored nothing: 0, as `RolloutBatch.success` counts it.
            out.setdefault(families[task_id], []).append(reward or 0.0)
        return out

    comparison = R.HoldoutComparison(
        snapshot_id=plan.holdout_snapshot.snapshot_id,
        parent_id=plan.parent.resource_id,
        candidate_id=plan.candidate_id,
        evaluator=plan.evaluator,
        seed=t.eval_seed,
        families=R.family_scores(per_family("candidate"), per_family("parent")),
    )
    protected_families: dict[str, dict[str, Any]] = {}
    for task in protected:
        entry = protected_families.setdefault(task["family"], {"n": 0, "regressed": [], "missing": 0})
        entry["n"] += 1
        before, after = (
            scores["parent"]["protected"].get(task["task_id"]),
            scores["candidate"]["protected"].get(task["task_id"]),
        )
        if before is None and after is None:
            entry["missing"] += 1
        elif (before or 0.0) >= t.success_threshold and (after or 0.0) < t.success_threshold:
            entry["regressed"].append(task["task_id"])
    protected_results = R.ProtectedResults(
        snapshot_id=plan.protected_snapshot.snapshot_id if plan.protected_snapshot else None,
        parent_id=plan.parent.resource_id,
        candidate_id=plan.candidate_id,
        families=[R.ProtectedFamily(family=f, **v) for f, v in sorted(protected_families.items())],
    )
    receipt = R.add_evaluation(receipt, comparison, protected_results)
    stored = ctx.append_receipt(store, receipt)
    overall = {side: _mean(per_family(side)) for side in ("parent", "candidate")}
    return StageResult(
        metadata={
            "heldout_tasks": len(holdout),
            "parent_success": overall["parent"],
            "candidate_success": overall["candidate"],
            "margin": round(overall["candidate"] - overall["parent"], 4),
            "per_family": Markdown(
                "| family | n | parent | candidate | margin |\n|---|---|---|---|---|\n"
                + "\n".join(
                    f"| {s.family} | {s.n} | {_fmt(s.parent_mean)} | {_fmt(s.candidate_mean)} | "
                    f"{_fmt(None if s.parent_mean is None or s.candidate_mean is None else s.candidate_mean - s.parent_mean)} |"
                    for s in comparison.families
                )
            ),
            "protected_cases": len(protected),
            "protected_regressions": sum(len(f.regressed) for f in protected_results.families),
            "receipt_version": stored.version,
        }
    )


def _mean(groups: dict[str, list[float]]) -> float:
    values = [v for vs in groups.values() for v in vs]
    return round(sum(values) / len(values), 4) if values else 0.0


def _fmt(x: float | None) -> str:
    return "unavailable" if x is None else f"{x:+.3f}" if x < 0 else f"{x:.3f}"


def canary_results(p: Any, key: str) -> StageResult:
    """The candidate on the canary tasks under limits; each outcome re-read at its destination (the runner
    records the harness's `verify` as an `effect` span)."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.training.loop import RolloutService
    from lightning_dagster.types import SpanKind

    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    if receipt.candidate is None:
        raise StageMissing(key, "candidate_resource")
    candidate_dir = reg.download(_version(receipt.candidate.uri))
    name = ctx.canary_harness(p)
    limits = R.CanaryLimits(
        max_tasks=p.training.canary_tasks,
        max_seconds=p.gate.canary_max_seconds,
        allowed_tools=ctx.canary_allowed_tools(p),
        max_cost=p.gate.canary_max_cost,
        allowed_side_effects=ctx.canary_destinations(p),
    )
    items = manifest["splits"]["canary"][: limits.max_tasks]
    with RolloutService(
        store, candidate_dir, harness=name, resource_id=receipt.plan.candidate_id, parallel=p.gateway.parallel
    ) as service:
        batch = service.run(
            items,
            group=1,
            kind=RolloutKind.canary,
            temperature=1.0,
            seed=p.training.eval_seed,
            tag=f"{key}-canary",
        )
        ids = [r.rollout_id for r in batch.rollouts]
        all_spans = store.list_spans(rollout_ids=ids)
        # A tool counts as used when the model called one the harness offers (only those can act); a call
        # to a tool that does not exist is answered with an error and has no effect.
        offered = {t["function"]["name"] for t in ctx.harness_tools(name) if "function" in t}
        called = {
            call["function"]["name"]
            for s in all_spans
            if s.kind == SpanKind.llm and s.response_token_ids
            for call in service.codec.parse_assistant(service.codec.decode(s.response_token_ids))[1]
        }
        tools_used = sorted(called & offered)
    effects = {
        s.rollout_id: s.attributes for s in all_spans if s.kind == SpanKind.custom and s.name == "effect"
    }
    destination = ctx.canary_destinations(p)[0]
    canary_tasks = []
    for r in batch.rollouts:
        effect = effects.get(r.rollout_id)
        if effect is None:
            canary_tasks.append(
                R.CanaryTask(
                    task_id=r.task_id,
                    verified=False,
                    evidence="reward posted by the harness only"
                    if r.rollout_id in batch.rewards
                    else "no outcome",
                    uncertainty=1.0,
                    harmful_effect=None,
                )
            )
        else:
            canary_tasks.append(
                R.CanaryTask(
                    task_id=r.task_id,
                    destination=destination,
                    verified=bool(effect.get("verified")),
                    evidence=str(effect.get("reason", "")),
                    harmful_effect=effect.get("harmful_effect"),
                )
            )
    report = R.CanaryReport(
        serving_resource_id=receipt.plan.candidate_id,
        limits=limits,
        usage=R.CanaryUsage(
            tasks=len(items),
            seconds=batch.seconds,
            tools_used=tools_used,
            cost=0.0,
            side_effects=sorted({t.destination for t in canary_tasks if t.destination}),
        ),
        tasks=canary_tasks,
    )
    ctx.save_stage(store, key, "canary_results", {"rollout_ids": ids})
    stored = ctx.append_receipt(store, R.add_canary(receipt, report))
    verified = sum(t.verified for t in canary_tasks)
    return StageResult(
        metadata={
            "canary_harness": name,
            "verified": f"{verified} of {len(canary_tasks)}",
            "verified_share": round(verified / len(canary_tasks), 4) if canary_tasks else None,
            "harmful_effects": sum(1 for t in canary_tasks if t.harmful_effect),
            "tools_used": tools_used,
            "seconds": round(batch.seconds, 2),
            "limits": limits.model_dump(),
            "receipt_version": stored.version,
        }
    )


def rollback_drill(p: Any, key: str) -> StageResult:
    """The registry's drill: resolve, verify bytes, load and serve the exact parent; the pointer stays."""
    from lightning_dagster.gate import receipt as R

    store, reg = p.get_store(), ctx.registry(p)
    receipt = ctx.head_receipt(store, key)
    result = reg.rollback_drill(_version(receipt.plan.parent.uri))
    drill = R.RollbackDrill(
        parent_id=receipt.plan.parent.resource_id,
        environment="separate gateway on 127.0.0.1 (registry.rollback_drill)",
        resolved=result.resolved and result.hash_ok,
        # A step the drill never reached was not tested: None (unavailable), not False.
        loaded=result.loaded if result.resolved and result.hash_ok else None,
        routed_back=result.served if result.loaded else None,
        at=result.at,
    )
    stored = ctx.append_receipt(store, R.add_rollback_drill(receipt, drill))
    return StageResult(
        metadata={
            "parent": receipt.plan.parent.uri,
            "resolved": result.resolved,
            "bytes_verified": result.hash_ok,
            "loaded": result.loaded,
            "served": result.served,
            "seconds": result.seconds,
            "error": result.error,
            "approvals": [a.model_dump() for a in receipt.approvals],
            "receipt_version": stored.version,
        }
    )


# ---------------------------------------------------------------- the gate


def reverified_receipt(p: Any, key: str) -> Any:
    """The receipt as the gate must see it: the ledger head with phase 2 rebuilt from the store over every
    rollout of the snapshot, every attempt and every span (not copied from an earlier asset)."""
    store = p.get_store()
    return collect_rollout_evidence(store, ctx.head_receipt(store, key), _snapshot_rollout_ids(store, key))


def current_fingerprints(p: Any, key: str, receipt: Any) -> dict[str, str | None]:
    """Fingerprints now: a moved `approved-default`, a changed evaluator or tool contract, or candidate bytes
    that no longer hash to what the canary served, each void the checks that depended on them."""
    from lightning_dagster.engine import checkpoint_hash
    from lightning_dagster.registry.core import APPROVED
    from lightning_dagster.registry.errors import RegistryError

    try:
        parent_hash = ctx.registry(p).resolve(APPROVED, download=False).weights_hash
    except RegistryError:
        parent_hash = None  # unavailable: compared as "not given", so the receipt's own record stands
    current = ctx.global_fingerprints(p, parent_hash)
    try:
        checkpoint = Path(ctx.load_stage(p.get_store(), key, "candidate_resource")["checkpoint"])
        current["serving_model"] = checkpoint_hash(checkpoint) if checkpoint.is_dir() else "missing"
    except StageMissing:
        current["serving_model"] = None
    return current


# Checks judged on the first batch alone, where their asset sits: coverage and retry debt of the rollouts
# sampled from the parent. `release_receipt` judges them again over every rollout against the full plan.
FIRST_BATCH_CHECKS = frozenset({2, 3})


def first_batch_receipt(p: Any, key: str) -> Any:
    """The receipt restricted to the first batch: its rollouts, and the plan's expectation for them."""
    store = p.get_store()
    receipt = ctx.head_receipt(store, key)
    algorithm = receipt.plan.algorithm
    planned = {RolloutKind.train: int(algorithm["tasks_per_step"]) * int(algorithm["group_size"])}
    plan = receipt.plan.model_copy(update={"expected_rollouts": planned})
    ids = ctx.load_stage(store, key, "rollouts")["rollout_ids"]
    return collect_rollout_evidence(store, receipt.model_copy(update={"plan": plan}), ids)


def judge(p: Any, key: str, check_id: int) -> CheckOutcome:
    """One of the seven checks on the evidence recorded so far (the same function the verdict uses)."""
    from lightning_dagster.gate.checks import CHECKS
    from lightning_dagster.gate.staleness import void_checks

    receipt = first_batch_receipt(p, key) if check_id in FIRST_BATCH_CHECKS else reverified_receipt(p, key)
    pol = ctx.policy(p)
    result = CHECKS[check_id][1](receipt, pol)
    void = void_checks(
        receipt.fingerprints,
        current_fingerprints(p, key, receipt),
        required=pol.staleness.required_fingerprints,
    )
    status, reason = result.status, result.reason
    if status == "pass" and check_id in void:
        status, reason = "fail", f"void: {'; '.join(void[check_id])}"
    return CheckOutcome(
        check_id, result.name, status, reason, {"figures": result.figures, "policy": pol.version}
    )


def release_receipt(p: Any, key: str, *, run_id: str = "") -> StageResult:
    """Phases 2 and 3 re-verified, all seven checks under the policy, the verdict; appended immutably."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.gate.checks import evaluate

    store = p.get_store()
    receipt = reverified_receipt(p, key)
    pol = ctx.policy(p)
    evaluation = evaluate(receipt, pol, current_fingerprints(p, key, receipt))
    final = R.with_gate_record(receipt, evaluation.to_record())
    stored = ctx.append_receipt(store, final)
    return StageResult(
        metadata={
            "verdict": evaluation.verdict,
            "receipt_id": final.receipt_id,
            "receipt_version": stored.version,
            "receipt_hash": stored.content_hash,
            "policy": f"{pol.version} ({pol.hash[:19]})",
            "checks": Markdown(markdown_checks(evaluation)),
            "hold_reasons": evaluation.hold_reasons,
            "stale_checks": evaluation.stale_checks,
            "orchestrator_run_id": run_id,
        },
        data_version=stored.content_hash,
    )


# ---------------------------------------------------------------- pointer operations (jobs)


def approve(p: Any, key: str, actor: str, role: str) -> StageResult:
    stored = ctx.registry(p).approve(ctx.receipt_id(key), actor, role)
    return StageResult(
        metadata={
            "receipt_id": stored.receipt.receipt_id,
            "receipt_version": stored.version,
            "actor": actor,
            "role": role,
        }
    )


def promote(p: Any, receipt_id: str, actor: str) -> StageResult:
    """The registry re-runs the gate on the ledger head with today's fingerprints and refuses HOLD, stale
    evidence, an unauthorized actor or a moved parent; a receipt `release_receipt` never judged is refused."""
    from lightning_dagster.registry.errors import PromotionRefused

    key = receipt_id.removeprefix("rcpt-")
    receipt = ctx.find_receipt(p.get_store(), key)
    if receipt is None or receipt.gate is None:
        raise PromotionRefused(
            f"receipt {receipt_id!r} has no gate verdict: materialize release_receipt first"
        )
    result = ctx.registry(p).promote(
        receipt_id, actor, policy=ctx.policy(p), current_fingerprints=current_fingerprints(p, key, receipt)
    )
    return StageResult(
        metadata={
            "approved_default": result.move.to_value,
            "from": result.move.from_value,
            "actor": actor,
            "receipt_id": receipt_id,
            "mirrored_to_mlflow": result.mirrored,
        }
    )


def rollback(p: Any, target_version: str, actor: str) -> StageResult:
    result = ctx.registry(p).rollback(target_version, actor)
    return StageResult(
        metadata={"approved_default": result.move.to_value, "from": result.move.from_value, "actor": actor}
    )
