"""The real stack for runner tests: the engine's base model built once into a tmp dir, served by the real
gateway over HTTP from a real SQLite store (all session-scoped)."""

from __future__ import annotations

import pytest

from lightning_dagster.engine import build_base_model
from lightning_dagster.gateway import gateway_options
from lightning_dagster.gateway.local import LocalGateway
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.runner.service import model_resource
from lightning_dagster.settings import ServingSettings
from lightning_dagster.store import Store


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return build_base_model(tmp_path_factory.mktemp("model") / "base", corpus=training_corpus())


@pytest.fixture(scope="session")
def store(tmp_path_factory):
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('store') / 'store.db'}")
    yield store
    store.close()


@pytest.fixture(scope="session")
def gateway(store, model_dir):
    resource = model_resource(store, model_dir)
    options = gateway_options(ServingSettings(engine_process=False))
    with LocalGateway(store, model_dir, options, resource_id=resource.resource_id) as gw:
        yield gw
