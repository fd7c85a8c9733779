"""The training process the `candidate_resource` asset launches through Dagster Pipes: it rebuilds the
pipeline settings from the Pipes extras, runs the core stage (`pipeline.stages.training.candidate_resource`)
and reports its result (metrics, checkpoint, MLflow version) back as one Pipes message. Under
torch.distributed.run (the training resource's `nproc`), rank 0 does this and the other ranks train its steps
(`training.loop.followed`).
Lives outside the core packages: it imports `dagster_pipes` and the Dagster resources."""

from __future__ import annotations

import json
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
    before rank 0 has read the Pipes extras. Rank 0 runs the stage and reports each step's metrics as a Pipes
    log line and the stage's result as one message; the other ranks follow it (`training.loop.followed`)."""
    from lightning_dagster.training.loop import followed, join

    group = join(device)
    if followed(group):
        return 0

    from dagster_pipes import open_dagster_pipes

    from lightning_dagster.orchestration.resources import PipelineResource
    from lightning_dagster.pipeline.stages import training

    with open_dagster_pipes() as pipes:
        pipeline = PipelineResource.model_validate(pipes.get_extra("pipeline"))

        def log(metrics: dict[str, Any]) -> None:
            pipes.log.info(json.dumps(metrics, default=str))

        result = training.candidate_resource(
            pipeline, pipes.get_extra("partition_key"), run_id=pipes.get_extra("run_id"), group=group, log=log
        )
        pipes.report_custom_message(encode(result))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1]))
