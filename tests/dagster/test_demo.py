"""The demo's two cycles with tiny settings on the session's bootstrapped home: stage lines in order as the
assets materialize, promotion by the demo's default approver, the sensor cutting snapshot 2 after new tasks,
cycle 2 from the promoted default, and a summary with both verdicts and the pointer history.

Cycle 1 promotes for the reason the pipeline-run tests' snapshot does: a parent warm-started long enough,
a tiny learning rate, and the test policy that does not demand a held-out margin 8 tasks cannot show."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dagster.pipeline import context as ctx
from lightning_dagster.registry.core import APPROVED
from tests.dagster.conftest import pipeline_for

PROMOTE = "PROMOTE TO BOUNDED CANARY"
STAGES = [
    "tasks",
    "update_plan",
    "approve",
    "rollouts",
    "spans",
    "training_transitions",
    "candidate_resource",
    "holdout_evaluation",
    "canary_results",
    "rollback_drill",
    "release_receipt",
]


@pytest.fixture
def demo_env(finished_demo, monkeypatch):
    """The environment the finished demo's printed commands set."""
    for name, value in finished_demo.env.items():
        monkeypatch.setenv(name, value)
    return finished_demo


def _stage_order(lines: list[str], cycle: int) -> list[str]:
    found = [re.match(rf"\[\s*\d+s\] cycle {cycle} (\w+):", line) for line in lines]
    return [m.group(1) for m in found if m and m.group(1) in STAGES]


@pytest.mark.slow
@pytest.mark.moves_session_pointer(rewrites_approvers=True)
def test_demo_runs_two_cycles_promotes_between_them_and_summarizes(demo_env, tmp_path):
    before, lines, (first, second) = demo_env.before, demo_env.lines, demo_env.cycles
    assert demo_env.warnings == []
    text = "\n".join(lines)

    # Stage lines as the assets materialized, in the graph's order, each cycle.
    assert _stage_order(lines, 1) == STAGES and _stage_order(lines, 2) == STAGES, text
    assert re.search(r"cycle 1 holdout_evaluation: held-out success parent [\d.]+ -> candidate [\d.]+", text)
    assert re.search(r"cycle 1 candidate_resource: 2 of 2 RL steps x 128 rollouts", text)

    # Cycle 1 earned promotion; the default approver's signed `promote` run moved the pointer.
    assert first.verdict == PROMOTE
    after = ctx.registry(pipeline_for()).current(APPROVED)
    promoted = ctx.find_receipt(pipeline_for().get_store(), first.key).candidate.model_version
    assert after == promoted != before
    assert f"promotion: approved-default -> {promoted} by bob" in text

    # New tasks made the real sensor cut snapshot 2 (after a tick that waited), and cycle 2 trained from the
    # promoted version.
    sensor = [line.split("] ", 1)[1] for line in lines if "] sensor:" in line]
    assert sensor[0].startswith("sensor: cut snapshot") and sensor[1].startswith("sensor: waiting: 0 of")
    assert sensor[2] == f"sensor: cut snapshot {second.key}"
    assert "new tasks: 128 train tasks added" in text
    assert second.parent_version == promoted

    # The summary: one verdict line per cycle, the pointer's move, its history.
    verdicts = [line for line in lines if line.startswith("verdict:")]
    assert verdicts == [first.line(), second.line()] and first.line().startswith(
        f"verdict: cycle 1 ({first.key}): {PROMOTE} under tiny-test-v1"
    )
    assert f"approved-default: {before} -> {promoted}" in lines
    assert f"cycle 2 trained from approved-default {promoted}: the promoted candidate" in lines
    start = lines.index("pointer history (lightning-dagster registry history):") + 1
    history = lines[start : lines.index("", start)]
    assert re.fullmatch(
        rf"\s+\d+\s+\S+\s+{before} -> {promoted}\s+bob receipt {first.receipt_id}", history[-1]
    )
    assert any(line.startswith("  Dagster UI:") for line in lines)
    assert "sensor: cursor kept for the UI: switching the sensor on cuts only new evidence" in text
    _mlflow_tells_the_stores_story([first, second])
    _the_code_location_recorded_the_ticks_and_runs(first, second, lines)
    _previews_change_nothing(tmp_path)


LOCATION = "lightning_dagster.orchestration.definitions"


def _the_code_location_recorded_the_ticks_and_runs(first, second, lines) -> None:
    """The demo's sensor ticks and runs are the code location's, as the UI finds them: the sensor's ticks
    (cut, skip with its reason, cut) under the location's sensor, each cycle's run on the job's page (the
    location's runs of `continual_learning`), the cut's run tagged with the sensor and its tick."""
    import dagster as dg

    from lightning_dagster.pipeline import loop_history

    with dg.DagsterInstance.get() as instance:
        (state,) = [s for s in instance.all_instigator_state() if s.name == "continual_learning_sensor"]
        assert state.origin.repository_origin.code_location_origin.location_name == LOCATION
        ticks = list(reversed(instance.get_ticks(state.instigator_origin_id, state.selector_id)))
        assert [t.status.value for t in ticks] == ["SUCCESS", "SKIPPED", "SUCCESS", "SKIPPED"], ticks
        said = [line.split("sensor: ", 1)[1] for line in lines if "] sensor: " in line]
        assert ticks[1].skip_reason == said[1] and said[1].startswith("waiting: 0 of")
        # the last tick says what the loop does next: paused (the condition and receipt), or waiting
        paused = loop_history.current_pause(pipeline_for().get_store()) is not None
        assert ticks[3].skip_reason == said[3] and said[3].startswith("paused: " if paused else "waiting: ")
        repository = {".dagster/repository": f"__repository__@{LOCATION}"}
        runs = instance.get_runs(dg.RunsFilter(job_name="continual_learning", tags=repository))
        by_sensor = [r for r in runs if r.tags.get("dagster/sensor_name") == "continual_learning_sensor"]
        assert {r.tags["dagster/partition"] for r in by_sensor} == {first.key, second.key}
        assert {r.run_id for t in ticks for r in by_sensor if r.run_id in t.run_ids} == {
            r.run_id for r in by_sensor
        }
        (cycle_1,) = [r for r in by_sensor if r.tags["dagster/partition"] == first.key]
        assert cycle_1.status == dg.DagsterRunStatus.SUCCESS  # cycle 1 promotes: every check passed
        for job in ("approve", "promote"):
            done = instance.get_runs(dg.RunsFilter(job_name=job, tags=repository))
            assert done and all(r.status == dg.DagsterRunStatus.SUCCESS for r in done), job
        # every run of the demo is the location's: none is "Manually launched" without an origin
        assert all(r.remote_job_origin is not None for r in instance.get_runs())


def _mlflow_tells_the_stores_story(cycles) -> None:
    """Every verdict, receipt version and pointer MLflow shows (version tags, the lineage run's tags, the
    alias) is the store's."""
    from mlflow import MlflowClient

    from lightning_dagster.gate.ledger import ReceiptLedger

    p = pipeline_for()
    reg = ctx.registry(p)
    client = MlflowClient(reg.tracking_uri, reg.tracking_uri)
    for cycle in cycles:
        receipt = ctx.find_receipt(p.get_store(), cycle.key)
        store_says = {
            "verdict": receipt.gate.verdict,
            "receipt_id": receipt.receipt_id,
            "receipt_version": str(len(ReceiptLedger(p.get_store()).history(receipt.receipt_id))),
        }
        version = client.get_model_version(reg.model_name, receipt.candidate.model_version)
        run = client.get_run(version.run_id)
        for shown in (version.tags, run.data.tags):
            assert {k: shown.get(k) for k in store_says} == store_says
        assert run.data.metrics["protected_cases"] == sum(f.n for f in receipt.protected.families)
    model = client.get_registered_model(reg.model_name)
    assert str(model.aliases[APPROVED]) == reg.current(APPROVED)


SENSORS = ("continual_learning_sensor", "stale_evidence_sensor", "approved_alias_sensor")


def _digests(root: Path) -> dict[str, str]:
    """Every file's sha256 (SQLite's -wal and -shm files aside: a reader may make them; the data is the
    database file after its last checkpoint)."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file() and not path.name.endswith(("-wal", "-shm", "-journal"))
    }


def _previews_change_nothing(tmp_path: Path) -> None:
    """Each sensor previewed twice on a copy of the finished demo's home, as the UI's "Preview tick result"
    does (Dagster's `sensor preview`, on the code location the demo's `dagster dev` command loads): the store,
    MLflow and the instance are byte for byte what they were. The continual-learning sensor, with the
    cursor the demo kept, waits: it proposes no retraining of the pool the cycles trained on."""
    import dagster as dg

    copy = tmp_path / "copy"
    shutil.copytree(os.environ["LIGHTNING_DAGSTER_HOME"], copy / "home")
    shutil.copytree(os.environ["DAGSTER_HOME"], copy / "dagster_home")
    env = {
        **os.environ,
        "LIGHTNING_DAGSTER_HOME": str(copy / "home"),
        "DAGSTER_HOME": str(copy / "dagster_home"),
    }
    with dg.DagsterInstance.from_config(str(copy / "dagster_home")) as instance:
        states = {s.name: s.instigator_data.cursor for s in instance.all_instigator_state()}
    assert json.loads(states["continual_learning_sensor"])["pool"]  # the watermark the demo kept
    before = _digests(copy)
    previews = []
    for _ in range(2):
        for name in SENSORS:
            cursor = ["--cursor", states[name]] if states.get(name) else []
            command = [sys.executable, "-m", "dagster", "sensor", "preview", name, *cursor]
            done = subprocess.run(
                [*command, "-m", "lightning_dagster.orchestration.definitions"],
                env=env, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert done.returncode == 0 and "Sensor return" in done.stdout, done.stdout + done.stderr[-2000:]
            previews.append(done.stdout)
    assert "waiting: 0 of" in previews[0] and "task pool unchanged" in previews[0], previews[0]
    # Cycle 2 added only train tasks: nothing either receipt was judged on changed.
    assert "skipping: no receipt has stale evidence" in previews[1], previews[1]
    assert "MLflow alias agrees" in previews[2], previews[2]
    after = _digests(copy)
    assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} == set()


def test_demo_help_says_it_runs_two_cycles_and_which_one_may_promote(capsys):
    from lightning_dagster.cli import main

    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert done.value.code == 0 and "Two release cycles of the Dagster pipeline" in text
    assert "Cycle 1:" in text and "cycle 2 runs on a new snapshot from approved-default" in text
    assert "if the verdict is PROMOTE TO BOUNDED CANARY, its candidate is promoted" in text
    assert "its candidate is promoted the same way if cycle 1's was not" in text and "once" not in text
