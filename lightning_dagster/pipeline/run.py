"""What a stage reads of its pipeline run: the settings of `lightning_dagster.settings`, nested by concern,
and the store they name. The Dagster `PipelineResource` has this shape; so may any object a script or test
passes (the core `pipeline` package does not import Dagster)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lightning_dagster.settings import (
        GateSettings,
        MLflowSettings,
        ProjectSettings,
        ServingSettings,
        StoreSettings,
        TrainingSettings,
    )
    from lightning_dagster.store import Store


class Pipeline(Protocol):
    """One pipeline run's settings (`lightning_dagster.settings.PipelineSettings`'s parts) and its store."""

    project: ProjectSettings
    store: StoreSettings
    mlflow: MLflowSettings
    serving: ServingSettings
    training: TrainingSettings
    gate: GateSettings

    def get_store(self) -> Store: ...
