"""Markdown tables and links the asset metadata shows."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_dagster.pipeline.results import Link

if TYPE_CHECKING:
    from lightning_dagster.gate.checks import Evaluation
    from lightning_dagster.pipeline.settings import Pipeline
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


def mlflow_links(p: Pipeline, reg: Registry, run_id: str, version: str) -> dict[str, Any]:
    """The run and version ids, and links into the MLflow UI when its address is known (`LD_MLFLOW_UI_URL`,
    an HTTP tracking server, else where the demo's printed `mlflow ui` command serves)."""
    links = reg.ui_links(run_id, version, ui=p.mlflow.ui_url or None)
    ids = {"mlflow_run_id": run_id, "mlflow_version": version}
    return {**ids, **{f"{name}_link": Link(url) for name, url in links.items()}}
