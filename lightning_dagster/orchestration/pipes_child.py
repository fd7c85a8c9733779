"""The training process the `candidate_resource` asset launches through Dagster Pipes: it rebuilds the
pipeline settings from the Pipes extras, runs the core stage (`pipeline.stages.training.candidate_resource`)
and reports its result (metrics, checkpoint, MLflow version) back as one Pipes message. Under
torch.distributed.run (the training resource's `nproc`), rank 0 does this and the other ranks train its steps.
Lives outside the core packages: it imports `dagster_pipes` and the Dagster resources."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from lightning_dagster.pipeline.results import Link, Markdown, StageResult, Table

KINDS: dict[str, type] = {"link": Link, "markdown": Markdown, "table": Table}


def encode(result: StageResult) -> dict[str, Any]:
    """A stage result as plain JSON: Link, Markdown and Table values tagged with their kind."""

    def value(v: Any) -> Any:
        for kind, cls in KINDS.items():
            if isinstance(v, cls):
                return {"__kind__": kind, **asdict(v)}
        return v

    return {
        "metadata": {k: value(v) for k, v in result.metadata.items()},
        "data_version": result.data_version,
    }


def decode(message: dict[str, Any]) -> StageResult:
    def value(v: Any) -> Any:
        if isinstance(v, dict) and v.get("__kind__") in KINDS:
            fields = {k: x for k, x in v.items() if k != "__kind__"}
            return KINDS[v["__kind__"]](**fields)
        return v

    return StageResult({k: value(v) for k, v in message["metadata"].items()}, message["data_version"])


def pipes_settings(pipeline: Any) -> dict[str, Any]:
    """The resolved pipeline settings the child rebuilds, without the gateway secret: Pipes extras are
    stored and shown by Dagster, so the child's gateway signs attempt keys with a fresh secret of its own."""
    settings = pipeline.model_dump()
    settings["serving"]["secret"] = ""
    return settings


def main(device: str) -> int:
    """`device`: the training resource's, given on the command line: every rank joins the process group
    before rank 0 has read the Pipes extras."""
    from lightning_dagster.engine.engine import resolve_device
    from lightning_dagster.training import distributed
    from lightning_dagster.training.trainer import Trainer

    group = None
    if distributed.launched_world_size() > 1:
        group = distributed.join(resolve_device(device))
    if group is not None and not group.leader:  # rank 0 names the parent and trainer settings, then the steps
        parent_dir, config = distributed.broadcast(None, group)
        distributed.follow(Trainer(parent_dir, config, group=group))
        return 0

    from dagster_pipes import open_dagster_pipes

    from lightning_dagster.orchestration.resources import PipelineResource
    from lightning_dagster.pipeline.stages import training

    with open_dagster_pipes() as pipes:
        pipeline = PipelineResource.model_validate(pipes.get_extra("pipeline"))
        result = training.candidate_resource(
            pipeline, pipes.get_extra("partition_key"), run_id=pipes.get_extra("run_id"), group=group
        )
        pipes.report_custom_message(encode(result))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1]))
