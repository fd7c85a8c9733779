"""The `evaluation` asset group: candidate against its exact parent on the closed sets, and the canary."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.context import StageMissing
from lightning_dagster.pipeline.results import Markdown, StageResult, Table
from lightning_dagster.pipeline.serving import rollout_service
from lightning_dagster.pipeline.snapshots import load_manifest
from lightning_dagster.training.step import EVAL_SAMPLING, GREEDY
from lightning_dagster.types import RolloutKind, SpanKind

if TYPE_CHECKING:
    from lightning_dagster.gate.receipt import ProtectedResults
    from lightning_dagster.pipeline.run import Pipeline


def holdout_evaluation(p: Pipeline, key: str) -> StageResult:
    """Parent and candidate on the same held-out and protected tasks with the same sampling seeds."""
    from lightning_dagster.gate import receipt as R
    from lightning_dagster.training.trainer import load_model

    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    plan, t = receipt.plan, ctx.settings(p).training
    if receipt.candidate is None:
        raise StageMissing(key, "candidate_resource")
    parent_dir = reg.download(ctx.registered_version(plan.parent))
    candidate_dir = reg.download(ctx.registered_version(receipt.candidate))
    holdout, protected = manifest.splits.holdout, manifest.splits.protected
    scores: dict[str, dict[str, dict[str, float | None]]] = {}
    harness, parent_id = ctx.harness_source(p).spec, plan.parent.resource_id
    with rollout_service(  # not `serves_parent`: the candidate's weights are loaded into it next
        p, parent_dir, snapshot_key=key, harness=harness, resource_id=parent_id, serves_parent=False
    ) as service:
        for side, model_dir, resource in (
            ("parent", None, parent_id),
            ("candidate", candidate_dir, plan.candidate_id),
        ):
            if model_dir is not None:
                service.load_weights(load_model(model_dir).state_dict(), resource)
            # Held-out success is sampled at T=1.0 (RL's effect shows there); protected cases are decoded
            # greedily, so "the parent passed and the candidate failed" is a regression, not sampling noise.
            for kind, items, sampling in (
                (RolloutKind.holdout, holdout, EVAL_SAMPLING),
                (RolloutKind.protected, protected, GREEDY),
            ):
                tag, seed = f"{key}-{side}-{kind.value}", t.eval_seed
                batch = service.run(items, group=1, kind=kind, sampling=sampling, seed=seed, tag=tag)
                by_task = {r.task_id: batch.rewards.get(r.rollout_id) for r in batch.rollouts}
                scores.setdefault(side, {})[kind.value] = by_task
    ctx.save_stage(store, key, "holdout_evaluation", {"scores": scores})
    families = {task["task_id"]: task["family"] for task in holdout + protected}

    def per_family(side: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for task_id, reward in scores[side]["holdout"].items():
            # A rollout that never posted a reward scored nothing: 0, as `RolloutBatch.success` counts it.
            out.setdefault(families[task_id], {})[task_id] = reward or 0.0
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
        before, after = (scores[side]["protected"].get(task["task_id"]) for side in ("parent", "candidate"))
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
    stored = ctx.append_receipt(store, key, R.add_evaluation(receipt, comparison, protected_results))
    overall = {side: _mean(per_family(side)) for side in ("parent", "candidate")}
    metadata = {
        "heldout_tasks": len(holdout),
        "parent_success": round(overall["parent"], 4),
        "candidate_success": round(overall["candidate"], 4),
        "margin": round(overall["candidate"] - overall["parent"], 4),  # as check 4: from exact means
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
        "regressed_cases": regressed_cases(protected, protected_results, scores),
        "receipt_version": stored.version,
    }
    return StageResult(metadata)


def task_text(task: dict[str, Any]) -> str:
    """What the agent was asked: the first text field a task has, else the task minus its ids as JSON."""
    for name in ("question", "prompt", "instruction", "input", "text"):
        if isinstance(task.get(name), str):
            return task[name]
    return json.dumps({k: v for k, v in task.items() if k not in ("task_id", "split")}, sort_keys=True)


def regressed_cases(
    protected: list[dict[str, Any]], results: ProtectedResults, scores: dict[str, dict[str, dict]]
) -> Table:
    """Each protected case the candidate lost, with its text and both rewards (not only its hash)."""
    by_id = {task["task_id"]: task for task in protected}
    before, after = scores["parent"]["protected"], scores["candidate"]["protected"]
    rows = [
        [family.family, task_id, task_text(by_id[task_id]), before.get(task_id), after.get(task_id)]
        for family in results.families
        for task_id in family.regressed
    ]
    return Table(columns=["family", "task_id", "task", "parent_reward", "candidate_reward"], rows=rows)


def _mean(groups: dict[str, dict[str, float]]) -> float:
    values = [v for vs in groups.values() for v in vs.values()]
    return sum(values) / len(values) if values else 0.0


def _fmt(x: float | None) -> str:
    return "unavailable" if x is None else f"{x:+.3f}" if x < 0 else f"{x:.3f}"


def canary_results(p: Pipeline, key: str) -> StageResult:
    """The candidate on the canary tasks under limits; each outcome re-read at its destination (`effect`)."""
    from lightning_dagster.gate import receipt as R

    store, reg = p.get_store(), ctx.registry(p)
    receipt, manifest = ctx.head_receipt(store, key), load_manifest(p, key)
    if receipt.candidate is None:
        raise StageMissing(key, "candidate_resource")
    candidate_dir = reg.download(ctx.registered_version(receipt.candidate))
    canary, settings = ctx.harness_source(p).spec, ctx.settings(p)  # the project's own harness
    limits = R.CanaryLimits(
        max_tasks=settings.training.canary_tasks,
        max_seconds=settings.gate.canary_max_seconds,
        allowed_tools=ctx.canary_allowed_tools(p, canary),
        max_cost=settings.gate.canary_max_cost,
        allowed_side_effects=ctx.canary_destinations(canary),
    )
    items = manifest.splits.canary[: limits.max_tasks]
    candidate_id, seed, tag = receipt.plan.candidate_id, settings.training.eval_seed, f"{key}-canary"
    with rollout_service(
        p, candidate_dir, snapshot_key=key, harness=canary, resource_id=candidate_id, serves_parent=False
    ) as service:
        batch = service.run(
            items, group=1, kind=RolloutKind.canary, sampling=EVAL_SAMPLING, seed=seed, tag=tag
        )
        all_spans = store.list_spans(rollout_ids=[r.rollout_id for r in batch.rollouts])
        # A tool counts as used when the model called one the harness offers (only those can act); a call
        # to a tool that does not exist is answered with an error and has no effect.
        offered = {t["function"]["name"] for t in canary.tools if "function" in t}
        tools_used = sorted(service.tools_called(all_spans) & offered)
    effects = {
        s.rollout_id: s.attributes for s in all_spans if s.kind == SpanKind.custom and s.name == "effect"
    }
    destination = ctx.canary_destinations(canary)[0]
    unverifiable = ctx.UNVERIFIABLE if canary.verify is None else None
    canary_tasks = []
    for r in batch.rollouts:
        effect = None if unverifiable else effects.get(r.rollout_id)
        if effect is None:
            evidence = "reward posted by the harness only" if r.rollout_id in batch.rewards else "no outcome"
            fields = {"verified": False, "evidence": evidence, "uncertainty": 1.0, "harmful_effect": None}
        else:
            fields = {
                "destination": destination,
                "verified": bool(effect.get("verified")),
                "evidence": str(effect.get("reason", "")),
                "harmful_effect": effect.get("harmful_effect"),
            }
        canary_tasks.append(R.CanaryTask(task_id=r.task_id, **fields))
    report = R.CanaryReport(
        serving_resource_id=candidate_id,
        limits=limits,
        usage=R.CanaryUsage(
            tasks=len(items),
            seconds=batch.seconds,
            tools_used=tools_used,
            cost=0.0,
            side_effects=sorted({t.destination for t in canary_tasks if t.destination}),
        ),
        tasks=canary_tasks,
        unverifiable=unverifiable,
    )
    stored = ctx.append_receipt(store, key, R.add_canary(receipt, report))
    verified = sum(t.verified for t in canary_tasks)
    metadata = {
        "canary_harness": canary.name,
        "verified": f"unavailable: {unverifiable}" if unverifiable else f"{verified} of {len(canary_tasks)}",
        "verified_share": round(verified / len(canary_tasks), 4) if canary_tasks else None,
        "harmful_effects": sum(1 for t in canary_tasks if t.harmful_effect),
        "tools_used": tools_used,
        "seconds": round(batch.seconds, 2),
        "limits": limits.model_dump(),
        "receipt_version": stored.version,
    }
    return StageResult(metadata)
