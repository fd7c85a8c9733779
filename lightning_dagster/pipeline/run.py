"""What a stage reads of its pipeline run: the settings of `lightning_dagster.settings`, nested by concern,
and the store they name. The Dagster `PipelineResource` has this shape; so may any object a script or test
passes (the core `pipeline` package does not import Dagster)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lightning_dagster import settings as s
    from lightning_dagster.store import Store


class Pipeline(Protocol):
    """One pipeline run's settings (`lightning_dagster.settings.PipelineSettings`'s parts) and its store."""

    project: s.ProjectSettings
    store: s.StoreSettings
    mlflow: s.MLflowSettings
    serving: s.ServingSettings
    training: s.TrainingSettings
    gate: s.GateSettings

    def get_store(self) -> Store: ...
