"""The training asset's Pipes transport: a stage result reported by a child process becomes the same asset
metadata as the in-process path."""

import sys

import dagster as dg

from lightning_dagster.orchestration.assets import through_pipes
from lightning_dagster.orchestration.assets.metadata import materialized
from lightning_dagster.orchestration.pipes_child import decode, encode
from lightning_dagster.pipeline.results import Link, Markdown, StageResult, Table

RESULT = StageResult(
    metadata={
        "checkpoint_uri": "file:///tmp/candidate",
        "steps": 3,
        "kl_coef": 0.1,
        "kept_parent_cases": None,
        "validation_curve": [[1, 0.5, 0], [2, 0.75, 1]],
        "mlflow_run_link": Link("http://127.0.0.1:5000/#/runs/abc"),
        "verdict": Markdown("**PROMOTE**"),
        "splits": Table(["split", "rows"], [["train", 8], ["holdout", 4]]),
    },
    data_version="sha256:feed",
)
CHILD = (
    "from dagster_pipes import open_dagster_pipes\n"
    "from lightning_dagster.orchestration.pipes_child import encode\n"
    "from tests.dagster.test_pipes import RESULT\n"
    "with open_dagster_pipes() as pipes:\n"
    "    assert pipes.get_extra('answer') == 42\n"
    "    pipes.report_custom_message(encode(RESULT))\n"
)


def test_encode_decode_round_trips_every_value_kind():
    assert decode(encode(RESULT)) == RESULT


def test_a_child_reported_result_materializes_with_the_in_process_metadata():
    @dg.asset
    def trained(context: dg.AssetExecutionContext, trainer_pipes: dg.PipesSubprocessClient):
        return through_pipes(context, trainer_pipes, [sys.executable, "-c", CHILD], {"answer": 42})

    @dg.asset
    def in_process():
        return materialized(RESULT)

    result = dg.materialize([trained, in_process], resources={"trainer_pipes": dg.PipesSubprocessClient()})
    events = {e.asset_key.path[0]: e.materialization for e in result.get_asset_materialization_events()}
    assert events["trained"].metadata == events["in_process"].metadata
    assert events["trained"].tags["dagster/data_version"] == "sha256:feed"
