"""The project file's `training:` / `serving:` / `gate:` sections and `effective`: the class defaults, under
the file's keys, under what a surface sets itself (a CLI flag given, a Dagster resource field set), and the
pipeline reading the result."""

from __future__ import annotations

import argparse
from importlib import resources

import dagster as dg
import pytest

from lightning_dagster.orchestration.pipes_child import pipes_settings
from lightning_dagster.orchestration.resources import (
    PipelineResource,
    ProjectResource,
    ServingResource,
    TrainingResource,
    default_pipeline,
)
from lightning_dagster.pipeline import context as ctx
from lightning_dagster.pipeline import serving
from lightning_dagster.project import load_project
from lightning_dagster.project.sections import effective
from lightning_dagster.settings import GateSettings, ServingSettings, TrainingSettings, add_flags, from_flags
from tests.project.helpers import write_project

SECTIONS = {
    "training.steps": 20,
    "training.learning_rate": 0.5,
    "training.attempt_timeout_s": 9.0,
    "serving.runner_mode": "subprocess",
    "serving.max_batch": 8,
}


def _flags(*argv: str) -> TrainingSettings:
    parser = argparse.ArgumentParser()
    add_flags(parser, TrainingSettings)
    return from_flags(TrainingSettings(), parser.parse_args(list(argv)))


def test_a_flag_given_wins_over_the_file_which_wins_over_the_default(tmp_path):
    project = load_project(write_project(tmp_path, SECTIONS))
    settings = effective(project, _flags("--steps", "3", "--learning-rate", "1e-4"))
    assert type(settings) is TrainingSettings
    assert settings.steps == 3  # the flag
    assert settings.learning_rate == 1e-4  # a flag given its default value still wins: it was given
    assert settings.attempt_timeout_s == 9.0  # the file
    assert settings.group_size == TrainingSettings().group_size  # the default
    assert effective(project, settings) == settings  # resolving again changes nothing
    # Without a project, a surface's own over the defaults; a concern without a section, its own alone.
    assert effective(None, _flags("--steps", "3")) == TrainingSettings(steps=3)
    assert effective(project, GateSettings(scope="s")) == GateSettings(scope="s")


def test_a_resource_field_set_wins_over_the_file(tmp_path):
    project = load_project(write_project(tmp_path, SECTIONS))
    settings = effective(project, TrainingResource(steps=3, kl_coef=0.0))
    assert type(settings) is TrainingSettings
    assert (settings.steps, settings.kl_coef, settings.learning_rate) == (3, 0.0, 0.5)
    # Dagster rebuilds a resource from its non-default fields, so one set to its default is not told apart
    # from one left alone: the file's value stands.
    assert effective(project, TrainingResource(steps=TrainingSettings().steps)).steps == 20
    served = effective(project, ServingResource(max_batch=16))
    assert type(served) is ServingSettings and (served.max_batch, served.runner_mode) == (16, "subprocess")


def _pipeline(root, **parts) -> PipelineResource:
    return default_pipeline(deferred=False, project=ProjectResource(project=str(root)), **parts)


def test_a_dagster_run_reads_the_file_under_the_resources_fields(tmp_path):
    # In a run Dagster rebuilds the resources and counts every Literal field (runner_mode) as set, at its
    # default: the file's `serving.runner_mode` must still apply.
    root = write_project(tmp_path, SECTIONS).parent
    seen = {}

    @dg.asset
    def probe(pipeline: PipelineResource) -> None:
        seen["settings"] = ctx.settings(pipeline)

    pipeline = _pipeline(root, training=TrainingResource(steps=3))
    assert dg.materialize([probe], resources={"pipeline": pipeline}).success
    settings = seen["settings"]
    assert (settings.serving.runner_mode, settings.serving.max_batch) == ("subprocess", 8)
    assert (settings.training.steps, settings.training.learning_rate) == (3, 0.5)
    assert settings == ctx.settings(pipeline)  # the same outside a run
    # The training child (Dagster Pipes) rebuilds the pipeline from its extras and resolves the same.
    assert ctx.settings(PipelineResource.model_validate(pipes_settings(pipeline))) == settings


def test_the_pipeline_runs_with_the_files_retry_policy_policy_file_and_upstream(tmp_path):
    policy = resources.files("lightning_dagster.gate").joinpath("policies/default-v1.yaml").read_text()
    (tmp_path / "policy.yaml").write_text(policy.replace("version: default-v1", "version: project-v1"))
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    changes = {
        **SECTIONS,
        "gate.policy_path": "policy.yaml",
        "serving.upstream_url": "http://127.0.0.1:9/v1",
        "model.tokenizer": "tok",
    }
    root = write_project(tmp_path, changes).parent
    p = _pipeline(root)
    spec = ctx.project_harness(ctx.pipeline_project(p))
    assert (spec.timeout_s, spec.max_attempts) == (9.0, 1)
    assert serving.retry_policy(p, spec).timeout_s == 9.0
    assert ctx.policy(p).version == "project-v1"
    assert serving.upstream_of(p) == ("http://127.0.0.1:9/v1", tmp_path / "tok")
    # The resource's own fields win: another timeout, the code location's upstream (with the project's
    # tokenizer, the served model's).
    p = _pipeline(
        root,
        training=TrainingResource(attempt_timeout_s=30.0),
        serving=ServingResource(upstream_url="http://10.0.0.1:8000/v1"),
    )
    assert serving.retry_policy(p, spec).timeout_s == 30.0
    assert serving.upstream_of(p) == ("http://10.0.0.1:8000/v1", tmp_path / "tok")


@pytest.mark.parametrize("flag", ["--steps", "--learning-rate"])
def test_a_bad_flag_value_names_the_flag(flag):
    from lightning_dagster.settings import SettingsError

    with pytest.raises(SettingsError, match=f"train: {flag}: "):
        parser = argparse.ArgumentParser()
        add_flags(parser, TrainingSettings)
        from_flags(TrainingSettings(), parser.parse_args([flag, "-1"]), command="train")
