"""Where the embedded default keeps its state, overridable by environment variables."""

from __future__ import annotations

import os
from pathlib import Path


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def home() -> Path:
    """The embedded default's working directory: `$LIGHTNING_DAGSTER_HOME` or `./.lightning_dagster`."""
    return _made(Path(os.environ.get("LIGHTNING_DAGSTER_HOME", Path.cwd() / ".lightning_dagster")).resolve())


def store_url() -> str:
    """`$LD_STORE_URL` (any SQLAlchemy URL, e.g. postgresql+psycopg2://...) or a SQLite file in `home()`."""
    return os.environ.get("LD_STORE_URL") or f"sqlite:///{home() / 'store.db'}"


def mlflow_tracking_uri() -> str:
    """`$MLFLOW_TRACKING_URI` or a SQLite tracking store in `home()` (four slashes: absolute path)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{home() / 'mlflow.db'}"


def mlflow_artifact_root() -> Path:
    return _made(Path(os.environ.get("LD_MLFLOW_ARTIFACTS", home() / "mlartifacts")).resolve())


def models_dir() -> Path:
    return _made(home() / "models")
