"""The first parent: the project's model (its `model.path`, else the embedded default built locally),
warm-started on the project's demonstrations when it has them, registered in MLflow and made
`approved-default` by a recorded pointer move. Runs once; later calls report the existing parent."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_dagster import paths
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.results import StageResult
from lightning_dagster.pipeline.versions import code_version

if TYPE_CHECKING:
    from lightning_dagster.pipeline.run import Pipeline


def bootstrap_parent(
    p: Pipeline, *, actor: str = "bootstrap", progress: Callable[[dict[str, Any]], None] | None = None
) -> StageResult:
    """`progress` (optional) receives the warm start's metrics after every SFT step."""
    from lightning_dagster.release.chain import pipeline_signer
    from lightning_dagster.training.configs import warm_start_config
    from lightning_dagster.training.warmstart import base_model, has_demos, warm_start

    reg = ctx.registry(p)
    chain = reg.verified()
    if chain.history and chain.value is None:
        chain.require()  # moves none of which verifies (a home from before moves were signed): say so
    if chain.value is not None:
        return StageResult({"approved_default": chain.value, "bootstrapped": False})
    project, settings = ctx.harness_source(p).project, ctx.settings(p)
    pipeline_signer(settings.gate)  # no pipeline key to sign the first move: refused before the warm start
    t, serving = settings.training, settings.serving
    base = base_model(project, t.seed)
    warmed: dict[str, object] = {"warm_start_steps": 0}
    parent = base
    if has_demos(project):
        config = warm_start_config(project.file, t, serving)
        result = warm_start(p.get_store(), base, paths.models_dir() / "parent-0", config, log=progress)
        parent = result.model_dir
        warmed = {
            "warm_start_steps": result.steps,
            "warm_start_steps_run": result.steps_run,
            "probe_success": result.probe_success,
            "seconds": round(result.seconds, 1),
        }
    version = reg.register_initial_parent(parent, actor=actor, code_revision=code_version("training"))
    metadata = {
        "approved_default": version.version,
        "bootstrapped": True,
        "project": project.name,
        "base_model": str(base),
        **warmed,
    }
    return StageResult(metadata, data_version=version.weights_hash)
