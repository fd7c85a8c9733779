"""The code location loads, and its graph, checks, jobs, sensors and schedule are exactly the designed ones."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

import dagster as dg
import pytest
import yaml

from lightning_dagster.orchestration.assets.gate_checks import GATE_CHECKS
from lightning_dagster.orchestration.definitions import defs
from lightning_dagster.orchestration.partitions import snapshots
from lightning_dagster.pipeline.snapshots import InvalidSnapshotKey, snapshot_key, validate_snapshot_key
from lightning_dagster.pipeline.triggers import Watermark

ROOT = Path(__file__).resolve().parents[2]

EDGES = {
    "tasks": set(),
    "update_plan": {"tasks"},
    "rollouts": {"update_plan"},
    "spans": {"rollouts"},
    "training_transitions": {"spans"},
    "candidate_resource": {"training_transitions"},
    "holdout_evaluation": {"candidate_resource"},
    "canary_results": {"holdout_evaluation"},
    "rollback_drill": {"canary_results"},
    "release_receipt": {
        "update_plan",
        "rollouts",
        "spans",
        "candidate_resource",
        "holdout_evaluation",
        "canary_results",
        "rollback_drill",
    },
}
CHECKS = {
    ("candidate_resource", "pinned"),
    ("spans", "span_coverage"),
    ("rollouts", "retry_debt"),
    ("holdout_evaluation", "heldout_margin"),
    ("holdout_evaluation", "protected_cases"),
    ("canary_results", "canary_verified"),
    ("rollback_drill", "rollback_and_approval"),
}


def test_asset_graph_has_exactly_the_designed_edges():
    graph = defs.get_repository_def().asset_graph
    edges = {
        key.to_user_string(): {p.to_user_string() for p in graph.get(key).parent_keys}
        for key in graph.get_all_asset_keys()
    }
    assert edges == EDGES
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.partitions_def == snapshots, key
        assert node.group_name in {"snapshot", "rollouts", "training", "evaluation", "release"}


def test_seven_blocking_error_checks_sit_on_the_assets_they_judge():
    graph = defs.get_repository_def().asset_graph
    assert {(k.asset_key.to_user_string(), k.name) for k in graph.asset_check_keys} == CHECKS
    specs = [spec for c in GATE_CHECKS for spec in c.check_specs]
    assert len(specs) == 7 and all(spec.blocking for spec in specs)


def test_jobs_sensors_schedule_and_trainer_pool():
    repo = defs.get_repository_def()
    assert {j.name for j in repo.get_all_jobs() if not j.name.startswith("__")} == {
        "continual_learning",
        "approve",
        "promote",
        "rollback",
        "resume",
        "restore_approved_alias",
    }
    sensors = {s.name: s for s in repo.sensor_defs}
    assert set(sensors) == {"continual_learning_sensor", "stale_evidence_sensor", "approved_alias_sensor"}
    # Documented in sensors.py: only the stale-evidence and alias-watch sensors start switched on.
    assert sensors["stale_evidence_sensor"].default_status == dg.DefaultSensorStatus.RUNNING
    assert sensors["approved_alias_sensor"].default_status == dg.DefaultSensorStatus.RUNNING
    assert sensors["continual_learning_sensor"].default_status == dg.DefaultSensorStatus.STOPPED
    (schedule,) = repo.schedule_defs
    assert schedule.name == "nightly_snapshot" and schedule.cron_schedule == "0 3 * * *"
    assert schedule.default_status == dg.DefaultScheduleStatus.STOPPED
    assert repo.asset_graph.get(dg.AssetKey("candidate_resource")).pools == {"trainer"}
    promote_config = repo.get_job("promote").run_config_schema.config_type.fields["ops"]
    assert "promote_candidate" in promote_config.config_type.fields


def test_every_launchpad_field_and_resource_says_what_it_takes():
    """The launchpad shows each op's config fields with their descriptions, and each resource's."""
    repo = defs.get_repository_def()
    undocumented = []
    for job in repo.get_all_jobs():
        ops = job.run_config_schema.config_type.fields["ops"].config_type.fields
        for op, field in ops.items():
            config = getattr(field.config_type, "fields", {}).get("config")
            for name, inner in getattr(config.config_type, "fields", {}).items() if config else []:
                if not inner.description:
                    undocumented.append(f"{job.name}.{op}.{name}")
    assert undocumented == []
    resources = repo.get_top_level_resources()
    assert [name for name, r in resources.items() if not r.description and name != "io_manager"] == []


def test_dagster_yaml_is_a_valid_postgres_instance_config(monkeypatch):
    from dagster._config import validate_config
    from dagster._core.instance.config import dagster_instance_config_schema

    for name, value in dict(HOST="127.0.0.1", PORT="5432", USER="dagster", PASSWORD="", DB="dagster").items():
        monkeypatch.setenv(f"DAGSTER_PG_{name}", value)
    config = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    assert config["storage"]["postgres"]["postgres_db"]["scheme"] == "postgresql+psycopg2"
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert config["run_monitoring"]["enabled"] is True
    assert config["concurrency"]["pools"]["default_limit"] == 1
    result = validate_config(dagster_instance_config_schema(), config)
    assert result.success, result.errors
    workspace = yaml.safe_load((ROOT / "workspace.yaml").read_text())
    assert (
        workspace["load_from"][0]["python_module"]["module_name"]
        == "lightning_dagster.orchestration.definitions"
    )


def test_snapshot_keys_are_content_hashed_and_restricted():
    at = dt.datetime(2026, 11, 30, 8, 0, tzinfo=dt.UTC)
    assert snapshot_key("1a2b3c4d" + "0" * 56, at) == "snap-20261130T0800Z-1a2b3c4d"
    for bad in ("a,b", "a|b", "a[1]", "", "x" * 129, "space key"):
        with pytest.raises(InvalidSnapshotKey):
            validate_snapshot_key(bad)
    with pytest.raises(InvalidSnapshotKey):
        snapshot_key("NOT-HEX", at)


def test_watermark_cursor_is_a_small_round_trip():
    mark = Watermark(serve_after=1234.5, pool="sha256:abc")
    cursor = mark.to_cursor()
    assert Watermark.from_cursor(cursor) == mark and len(cursor) < 200
    assert Watermark.from_cursor(None) == Watermark()


def test_the_code_location_trains_and_judges_with_the_demos_settings_and_the_policys_minimums():
    from lightning_dagster.demo import demo_training
    from lightning_dagster.gate.policy import load_policy
    from lightning_dagster.orchestration.resources import default_pipeline
    from lightning_dagster.pipeline import context as ctx

    location = defs.resources["pipeline"]
    assert location.training == demo_training(False)
    demo = default_pipeline(deferred=False, training=demo_training(False))
    # The same evaluator, tools, retry policy, permissions and destinations: the same fingerprints.
    assert ctx.fingerprint_inputs(demo) == ctx.fingerprint_inputs(default_pipeline(deferred=False))
    assert location.training.holdout_tasks >= load_policy().checks.heldout_margin.min_n


def test_a_changed_fingerprint_names_the_setting_that_changed():
    from lightning_dagster.gate.staleness import changed_settings

    recorded = {
        "evaluator": {"holdout_tasks": 128, "version": "1"},
        "permissions": ["a"],
        "destinations": ["d"],
    }
    now = {
        "evaluator": {"holdout_tasks": 64, "version": "1"},
        "permissions": ["a", "b"],
        "destinations": ["d"],
    }
    assert changed_settings(recorded, now) == {
        "evaluator": ["holdout_tasks: 128 -> 64"],
        "permissions": ["['a'] -> ['a', 'b']"],
    }


def test_job_config_fields_say_what_they_are_and_where_to_find_their_values():
    for job, op in (
        ("approve", "approve_receipt"),
        ("promote", "promote_candidate"),
        ("rollback", "rollback_default"),
    ):
        fields = defs.resolve_job_def(job).run_config_schema.config_type.fields["ops"].config_type.fields[op]
        for name, field in fields.config_type.fields["config"].config_type.fields.items():
            assert field.description, f"{job}.{name} has no description"
    promote = defs.resolve_job_def("promote").run_config_schema.config_type.fields["ops"]
    receipt_field = promote.config_type.fields["promote_candidate"].config_type.fields["config"]
    assert "release_receipt" in receipt_field.config_type.fields["receipt_id"].description


def test_span_coverage_check_says_it_judges_the_first_batch_only():
    (coverage,) = [c for c in GATE_CHECKS if next(iter(c.check_specs)).name == "span_coverage"]
    assert "first batch only" in next(iter(coverage.check_specs)).description


def test_a_plan_too_small_for_its_policy_says_which_check_it_cannot_pass():
    import json

    from lightning_dagster.gate.policy import load_policy
    from lightning_dagster.gate.receipt import Receipt
    from lightning_dagster.pipeline.stages.snapshot import policy_shortfalls

    data = json.loads((ROOT / "examples" / "gate" / "candidate-a.json").read_text())
    data.pop("attestation")  # the file's pipeline signature, not part of the receipt
    plan = Receipt.model_validate(data).plan
    policy = load_policy()
    small = plan.model_copy(
        update={"holdout_snapshot": plan.holdout_snapshot.model_copy(update={"n_tasks": 64})}
    )
    (reason,) = policy_shortfalls(small, policy)
    assert reason.startswith("check 4 needs at least 100 held-out tasks") and "the plan has 64" in reason
    large = plan.model_copy(
        update={"holdout_snapshot": plan.holdout_snapshot.model_copy(update={"n_tasks": 128})}
    )
    assert policy_shortfalls(large, policy) == []


@pytest.mark.parametrize("ui", ["http://127.0.0.1:5123", "https://mlflow.example.org"])
def test_the_mlflow_ui_address_shown_is_the_one_configured_when_the_code_location_loads(ui, tmp_path):
    """The assets whose materializations keep MLflow page paths carry the UI's address as definition
    metadata, read when the code location loads (as the UI's reload does), not when they materialized."""
    import subprocess
    import sys

    show = (
        "from lightning_dagster.orchestration.definitions import defs\n"
        "for name in ('candidate_resource', 'release_receipt'):\n"
        "    spec = defs.get_assets_def(name).specs_by_key[dg.AssetKey(name)]\n"
        "    print(name, spec.metadata['mlflow_ui'].value)\n"
    )
    env = {**os.environ, "LD_MLFLOW_UI_URL": ui, "LIGHTNING_DAGSTER_HOME": str(tmp_path / "home")}
    done = subprocess.run(
        [sys.executable, "-c", "import dagster as dg\n" + show],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == [f"candidate_resource {ui}", f"release_receipt {ui}"]


def _job_texts():
    """(config class, field, a valid config) of every text field of the launchpad's job configs."""
    from lightning_dagster.orchestration import jobs

    valid = {
        jobs.ApproveConfig: {"snapshot_key": "k", "actor": "a", "at": 1.0, "evidence_hash": "h", "signature": "s"},
        jobs.PromoteConfig: {
            "receipt_id": "rcpt-k", "actor": "a", "role": "r", "seq": 2, "at": 1.0, "signature": "s",
        },
        jobs.RollbackConfig: {
            "target_version": "1", "from_version": "2", "from_seq": 1, "actor": "a", "reason": "r", "at": 1.0,
            "signature": "s",
        },
        jobs.ResumeConfig: {"actor": "a", "reason": "r", "at": 1.0, "pause_hash": "h", "signature": "s"},
    }  # fmt: skip
    return [
        (cls, name, config)
        for cls, config in valid.items()
        for name, field in cls.model_fields.items()
        if field.annotation is str
    ]


@pytest.mark.parametrize(("cls", "name", "config"), _job_texts(), ids=lambda v: getattr(v, "__name__", v))
def test_a_job_config_field_given_an_empty_string_is_refused_by_name(cls, name, config):
    """A name, key, version, reason or signature of "" means nothing: the config refuses it, naming the
    field (a run given it fails before its op does anything)."""
    from pydantic import ValidationError

    assert cls(**config)  # the valid config is accepted
    with pytest.raises(ValidationError) as refused:
        cls(**{**config, name: ""})
    assert [(e["loc"], e["type"]) for e in refused.value.errors()] == [((name,), "string_too_short")]


PROMOTE_FIELDS = {"receipt_id": "rcpt-k", "role": "r", "seq": 2, "at": 1.0, "signature": "s"}


def test_a_promote_run_given_an_empty_actor_fails_naming_the_field():
    result = defs.resolve_job_def("promote").execute_in_process(
        run_config={"ops": {"promote_candidate": {"config": {**PROMOTE_FIELDS, "actor": ""}}}},
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.is_step_failure]
    error = failure.step_failure_data.error
    while error.cause is not None:
        error = error.cause
    assert "PromoteConfig\nactor\n  String should have at least 1 character" in error.message
