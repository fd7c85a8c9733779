"""The gate's stage table (which stage produces the evidence each blocking check judges, in graph order)
agrees with the Dagster graph, so "`<stage>` did not run" names a real asset that really did not run."""

from __future__ import annotations

import dagster as dg

from lightning_dagster.gate.stage_table import STAGES
from lightning_dagster.orchestration.assets.gate_checks import JUDGED_ASSET
from lightning_dagster.orchestration.definitions import defs


def test_each_blocking_check_sits_on_its_stage_and_stages_follow_the_graph_order():
    graph = defs.get_repository_def().asset_graph
    for stage in STAGES:
        for check in stage.blocking:
            judged = JUDGED_ASSET[check].key
            # the rollouts stage covers both assets of phase 2: rollouts (retry debt) and spans (coverage)
            assert (
                judged == dg.AssetKey(stage.name) or dg.AssetKey(stage.name) in graph.get(judged).parent_keys
            )
    for before, after in zip(STAGES, STAGES[1:], strict=False):
        assert dg.AssetKey(before.name) in graph.get_ancestor_asset_keys(dg.AssetKey(after.name))
