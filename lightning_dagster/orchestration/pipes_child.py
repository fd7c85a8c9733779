"""The training process `candidate_resource` launches through Dagster Pipes: it runs the stage and reports
its result as one Pipes message (under torch.distributed.run, from rank 0)."""

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
    """The settings the child rebuilds, without the gateway secret: Dagster stores and shows Pipes extras."""
    settings = pipeline.model_dump()
    settings["serving"]["secret"] = ""
    return settings


def main(device: str) -> int:
    """`device` comes on the command line: every rank joins the process group before Pipes is read."""
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
