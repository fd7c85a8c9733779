"""MLflow UI addresses for asset metadata, each asking for the classic ML view (MLflow 3's UI otherwise may
open on an empty GenAI traces page)."""

from __future__ import annotations

import os
from urllib.parse import quote

from lightning_dagster.registry.tracking import is_http

# Where the `mlflow ui` command the demo prints serves (`-h 127.0.0.1 -p 5000`).
DEFAULT_UI_URL = "http://127.0.0.1:5000"
UI_URL_ENV = "LD_MLFLOW_UI_URL"
WORKFLOW = "workflowType=machine_learning"


def ui_url(tracking_uri: str) -> str:
    """`$LD_MLFLOW_UI_URL` when set (empty: no links), else the tracking server, else `DEFAULT_UI_URL`."""
    if UI_URL_ENV in os.environ:
        return os.environ[UI_URL_ENV].rstrip("/")
    return tracking_uri.rstrip("/") if is_http(tracking_uri) else DEFAULT_UI_URL


def current_ui() -> str:
    from lightning_dagster import paths

    return ui_url(paths.mlflow_tracking_uri())


def run_path(experiment_id: str, run_id: str) -> str:
    """A run's page relative to the MLflow UI's address (what metadata keeps: the address may change)."""
    return f"#/experiments/{quote(str(experiment_id), safe='')}/runs/{quote(run_id, safe='')}?{WORKFLOW}"


def model_version_path(model_name: str, version: str | int) -> str:
    return f"#/models/{quote(model_name, safe='')}/versions/{quote(str(version), safe='')}?{WORKFLOW}"


def resolve(ui: str, path: str) -> str:
    return f"{ui.rstrip('/')}/{path}"


def experiment_url(ui: str, experiment_id: str) -> str:
    return f"{ui.rstrip('/')}/#/experiments/{quote(str(experiment_id), safe='')}/runs?{WORKFLOW}"


def run_url(ui: str, experiment_id: str, run_id: str) -> str:
    return resolve(ui, run_path(experiment_id, run_id))


def model_version_url(ui: str, model_name: str, version: str | int) -> str:
    return resolve(ui, model_version_path(model_name, version))
