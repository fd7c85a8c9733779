"""A model or tokenizer folder is checked from its files before anything loads it: the project file, the
`rollouts run --model` option and the engine's text side name what is missing instead of a transformers
traceback, and a `--model` folder given is never built over."""

from __future__ import annotations

import json

import pytest

from lightning_dagster.cli import main
from lightning_dagster.model_folder import ModelFolderError, check_model_folder, model_folder_problems
from lightning_dagster.project import ProjectError, load_project
from tests.project.helpers import write_project

TEMPLATE = {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}


def _folder(path, *, config="{}", tokenizer_config=TEMPLATE, files=()):
    path.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (path / "config.json").write_text(config)
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for name in files:
        (path / name).write_text("{}")
    return path


@pytest.mark.parametrize(
    ("kwargs", "weights", "fragment"),
    [
        ({"config": None}, True, "has no config.json"),
        ({"config": "{oops"}, True, "config.json is not readable JSON"),
        ({"tokenizer_config": None}, True, "has no tokenizer"),
        ({"tokenizer_config": {}}, True, "the tokenizer has no chat template"),
        ({"tokenizer_config": {"chat_template": ""}}, False, "the tokenizer has no chat template"),
    ],
)
def test_a_folder_that_cannot_serve_chats_is_named(tmp_path, kwargs, weights, fragment):
    folder = _folder(tmp_path / "m", **kwargs)
    with pytest.raises(ModelFolderError, match=fragment):
        check_model_folder(folder, weights=weights)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"tokenizer_config": {}, "files": ["chat_template.jinja"]},
        {"tokenizer_config": None, "files": ["tokenizer.json", "chat_template.json"]},
    ],
)
def test_a_folder_with_a_tokenizer_and_a_chat_template_passes(tmp_path, kwargs):
    assert model_folder_problems(_folder(tmp_path / "m", **kwargs)) == []
    assert model_folder_problems(tmp_path / "absent") == ["does not exist"]


def test_the_project_file_refuses_a_model_without_a_chat_template(tmp_path):
    _folder(tmp_path / "model", tokenizer_config={})
    file = write_project(tmp_path, {"model": {"path": "model"}})
    with pytest.raises(ProjectError) as caught:
        load_project(file)
    assert caught.value.keys == ["model.path"]
    assert "the tokenizer has no chat template" in str(caught.value)


def test_the_project_file_refuses_an_upstream_tokenizer_folder_without_a_tokenizer(tmp_path):
    _folder(tmp_path / "tok", config=None, tokenizer_config=None)
    file = write_project(
        tmp_path, {"model": {"tokenizer": "tok"}, "serving.upstream_url": "http://127.0.0.1:9"}
    )
    with pytest.raises(ProjectError) as caught:
        load_project(file)
    assert caught.value.keys == ["model.tokenizer"]
    assert "has no tokenizer" in str(caught.value)


def test_rollouts_run_refuses_a_model_folder_instead_of_building_one_there(tmp_path, capsys):
    missing = tmp_path / "typo"
    argv = [
        "rollouts",
        "run",
        "--harness",
        "calc",
        "--n",
        "1",
        "--store-url",
        f"sqlite:///{tmp_path / 's.db'}",
    ]
    assert main([*argv, "--model", str(missing)]) == 2
    assert f"--model: {missing}: does not exist" in capsys.readouterr().err
    assert not missing.exists()
    _folder(tmp_path / "bare", tokenizer_config=None)
    assert main([*argv, "--model", str(tmp_path / "bare")]) == 2
    assert "has no tokenizer" in capsys.readouterr().err
