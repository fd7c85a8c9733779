"""The first parent: a base model built locally, warm-started by the training package, registered in MLflow
and made `approved-default` by a recorded pointer move. Runs once; later calls report the existing parent."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dagster import config
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline.results import StageResult

if TYPE_CHECKING:
    from lightning_dagster.pipeline.settings import Pipeline


def bootstrap_parent(p: Pipeline, *, actor: str = "bootstrap") -> StageResult:
    from lightning_dagster.engine import build_base_model
    from lightning_dagster.harnesses.registry import training_corpus
    from lightning_dagster.registry.core import APPROVED
    from lightning_dagster.training.warmstart import WarmStartConfig, warm_start

    reg = ctx.registry(p)
    current = reg.current(APPROVED)
    if current is not None:
        return StageResult(metadata={"approved_default": current, "bootstrapped": False})
    base = config.models_dir() / "base"
    if not (base / "config.json").is_file():
        build_base_model(base, corpus=training_corpus(seed=p.model.seed), seed=p.model.seed)
    t = p.training
    result = warm_start(
        p.get_store(),
        base,
        config.models_dir() / "parent-0",
        WarmStartConfig(
            harness=p.model.harness,
            max_steps=t.warm_start_max_steps,
            min_steps=min(4, t.warm_start_max_steps),
            probe_tasks=t.warm_start_probe_tasks,
            demos=t.warm_start_demos,
            seed=p.model.seed,
            parallel=p.gateway.parallel,
        ),
    )
    version = reg.register_initial_parent(
        result.model_dir, actor=actor, code_revision=ctx.code_version("training")
    )
    return StageResult(
        metadata={
            "approved_default": version.version,
            "bootstrapped": True,
            "warm_start_steps": result.steps,
            "probe_success": result.probe_success,
            "seconds": round(result.seconds, 1),
        },
        data_version=version.weights_hash,
    )
