"""Markdown tables and links the asset metadata shows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import yaml

from lightning_dagster.pipeline.results import Markdown, Table

if TYPE_CHECKING:
    from lightning_dagster.gate.checks import Evaluation
    from lightning_dagster.pipeline.run import Pipeline
    from lightning_dagster.registry.core import Registry


def family_table(splits: dict[str, list[dict]]) -> str:
    families = sorted({t.get("family", "?") for items in splits.values() for t in items})
    header = "| family | " + " | ".join(splits) + " |\n|---|" + "---|" * len(splits) + "\n"
    rows = [
        f"| {f} | "
        + " | ".join(str(sum(1 for t in items if t.get("family", "?") == f)) for items in splits.values())
        + " |"
        for f in families
    ]
    return header + "\n".join(rows)


def markdown_checks(evaluation: Evaluation) -> str:
    """The verdict, the stages a blocking check stopped (with why), and one row per check."""
    lines = [f"**{evaluation.verdict}**", ""]
    lines += [f"- `{stage}` did not run: {why}" for stage, why in evaluation.not_run.items()]
    if evaluation.not_run:
        lines.append("")
    lines += ["| # | check | status | reason |", "|---|---|---|---|"]
    for c in evaluation.checks:
        status = c.status + (" (void)" if c.void else "")
        reason = (c.reason + ("; void: " + "; ".join(c.void) if c.void else "")).replace("|", "/")
        lines.append(f"| {c.id:d} | {c.title} | {status} | {reason} |")
    return "\n".join(lines)


def mlflow_links(reg: Registry, run_id: str, version: str) -> dict[str, Any]:
    """The run and version ids and their MLflow UI pages as paths relative to its address: metadata outlives
    the address, so it is the reader's current setting (`registry.links.resolve`), never fixed here."""
    from lightning_dagster.registry import links

    reg.connect()
    return {
        "mlflow_run_id": run_id,
        "mlflow_version": version,
        "mlflow_run_path": links.run_path(str(reg.experiment_id), run_id),
        "mlflow_model_version_path": links.model_version_path(reg.model_name, version),
    }


def run_config(op: str, **config: Any) -> str:
    """The exact launchpad run config of a one-op job, as YAML."""
    return yaml.safe_dump({"ops": {op: {"config": config}}}, sort_keys=False)


def yaml_block(op: str, **config: Any) -> str:
    return f"```yaml\n{run_config(op, **config)}```"


def receipt_guide(p: Pipeline, key: str) -> dict[str, Any]:
    """What `release_receipt` shows besides the verdict: the model it judged, MLflow links, and the values
    the approve / promote / rollback jobs take."""
    from lightning_dagster.pipeline import context as ctx
    from lightning_dagster.registry.errors import RegistryError
    from lightning_dagster.release.promotion import DEFAULT_APPROVER
    from lightning_dagster.release.roles import registry_roles

    store, reg = p.get_store(), ctx.registry(p)
    receipt = ctx.head_receipt(store, key)
    plan, candidate = receipt.plan, receipt.candidate
    out: dict[str, Any] = {
        "candidate_version": candidate.model_version if candidate else None,
        "parent_version": plan.parent.model_version,
        "snapshot": key,
        "evaluator": f"{plan.evaluator.name}@{plan.evaluator.version}",
        "stale": bool(receipt.gate and receipt.gate.stale_checks),
    }
    if (stage := ctx.load_doc(store, ctx.STAGES, f"{key}/candidate_resource")) is not None:
        out.update(mlflow_links(reg, stage["run_id"], stage["version"]))
    try:
        actors = registry_roles(reg).actors
    except RegistryError:
        actors = {}
    rows = [[a, ", ".join(sorted(k.roles))] for a, k in sorted(actors.items())]
    out["actors"] = Table(columns=["actor", "roles"], rows=rows)
    approvers = [a for a, k in sorted(actors.items()) if set(k.roles) & set(plan.approvers.default)]
    actor = approvers[0] if approvers else "ACTOR"
    history = reg.verified().moves  # the rollback targets come from the verified history only
    current = history[-1].to_value if history else None
    targets = sorted({m.to_value for m in history[:-1]} - {current}, key=int)
    back = targets[-1] if targets else "VERSION"
    rollback_actor = next((a for a, k in sorted(actors.items()) if DEFAULT_APPROVER in k.roles), "ACTOR")
    rid = receipt.receipt_id
    steps = [
        "**approve**: `lightning-dagster registry sign "
        f"{rid} --actor ACTOR --role ROLE --key KEYFILE` prints the fields; paste them with",
        yaml_block(
            "approve_receipt",
            snapshot_key=key,
            actor="ACTOR",
            role="ROLE",
            step="canary",
            at="AT",
            evidence_hash="HASH",
            signature="SIGNATURE",
        ),
        f"**promote** (after `lightning-dagster registry approve {rid} --actor {actor} --role "
        f"{plan.approvers.default[0] if plan.approvers.default else 'ROLE'} --key KEYFILE`):",
        f"then `lightning-dagster registry sign-promote {rid} --actor {actor} --key KEYFILE` prints the signed "
        "move's fields; paste them with",
        yaml_block(
            "promote_candidate",
            receipt_id=rid,
            actor=actor,
            role="ROLE",
            seq="SEQ",
            at="AT",
            signature="SIGNATURE",
        ),
        f"**rollback** (approved-default is {current or 'unset'}; earlier versions: "
        f"{', '.join(targets) or 'none'}): `lightning-dagster registry sign-rollback {back} --actor "
        f"{rollback_actor} --key KEYFILE --reason REASON` prints the fields; paste them with",
        yaml_block(
            "rollback_default",
            target_version=back,
            from_version=current or "VERSION",
            from_seq=history[-1].seq if history else "SEQ",
            actor=rollback_actor,
            role=DEFAULT_APPROVER,
            reason="REASON",
            at="AT",
            signature="SIGNATURE",
        ),
    ]
    return out | {"run_config": Markdown("\n\n".join(steps)), "rollback_targets": targets}
