"""Dagster resources: each *is* its `lightning_dagster.settings` class (defaults from `paths`, so `dagster
dev` needs no setup); the stages read them through `pipeline.context.settings`."""

from __future__ import annotations

import os
from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from lightning_dagster import settings


class _SettingsResource(dg.ConfigurableResource):
    def given(self) -> dict[str, Any]:
        """The fields not at their default: Dagster rebuilds a resource from its non-default values."""
        fields = type(self).model_fields
        return {
            name: value
            for name, value in super().given().items()  # type: ignore[misc]
            if value != fields[name].get_default(call_default_factory=True)
        }


class ProjectResource(_SettingsResource, settings.ProjectSettings):
    """What the pipeline trains: a user project, else a built-in example."""


class StoreResource(_SettingsResource, settings.StoreSettings):
    """The durable store (rollouts, attempts, spans, receipts, pointers)."""

    _store: object = PrivateAttr(default=None)

    def get(self):
        # One Store (one SQLAlchemy engine) per process: each asset op re-uses the connection pool.
        if self._store is None:
            from lightning_dagster.store import Store

            self._store = Store(self.resolved_url())
        return self._store


class MLflowResource(_SettingsResource, settings.MLflowSettings):
    """Where candidate lineage and the two pointers live."""


class ServingResource(_SettingsResource, settings.ServingSettings):
    """What serves the policy to the harness, and how the harness runs."""


class TrainingResource(_SettingsResource, settings.TrainingSettings):
    """RL, evaluation and checkpoint selection: the same defaults (and evaluator fingerprint) everywhere."""


class GateResource(_SettingsResource, settings.GateSettings):
    """The versioned release policy, who approves, and the bounded canary."""


class PipelineResource(dg.ConfigurableResource):
    """All settings of one pipeline run, nested by concern (the shape of `pipeline.run.Pipeline`)."""

    project: ProjectResource
    store: StoreResource
    mlflow: MLflowResource
    serving: ServingResource
    training: TrainingResource
    gate: GateResource
    _keyed: object = PrivateAttr(default=None)

    def get_store(self):
        store = self.store.get()
        if self._keyed is not store:
            # receipt ledgers attest with the pipeline key (`gate.ledger.use_keys`); a bad key file fails here
            from lightning_dagster.gate.ledger import use_keys
            from lightning_dagster.release.pipeline_key import keys

            use_keys(store, keys(self.gate))
            self._keyed = store
        return store


def default_pipeline(*, deferred: bool = True, **overrides: dg.ConfigurableResource) -> PipelineResource:
    """The code location's pipeline resource from environment variables (a gateway secret: `SecretError`)."""
    from lightning_dagster.gateway.keys import refuse_env_secrets

    refuse_env_secrets()

    def env(**variables: str) -> dict[str, dg.EnvVar | str]:
        return {
            field: dg.EnvVar(name) if deferred else os.environ[name]
            for field, name in variables.items()
            if os.environ.get(name)
        }

    parts: dict[str, dg.ConfigurableResource] = {
        "project": ProjectResource(**env(project="LD_PROJECT", harness="LD_HARNESS")),
        "store": StoreResource(**env(url="LD_STORE_URL")),
        "mlflow": MLflowResource(**env(tracking_uri="MLFLOW_TRACKING_URI", ui_url="LD_MLFLOW_UI_URL")),
        "serving": ServingResource(**env(upstream_url="LD_UPSTREAM_URL")),
        "training": TrainingResource(),
        "gate": GateResource(**env(**settings.GATE_ENV)),
    }
    parts.update(overrides)
    return PipelineResource(**parts)
