"""One base model built per session (~4 s) and one engine loaded from it, shared by the engine tests."""

from __future__ import annotations

import pytest

from lightning_dagster.engine import Engine, build_base_model
from lightning_dagster.harnesses.corpus import training_corpus


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("base") / "model", corpus=training_corpus(seed=0), seed=0)


@pytest.fixture(scope="session")
def engine(model_dir) -> Engine:
    return Engine(model_dir)
