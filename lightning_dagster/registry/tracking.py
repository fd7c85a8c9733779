"""Connecting to an MLflow tracking store: SQLite initialised once under a file lock (processes migrating a
fresh file at once fail with "table already exists"), servers probed fast."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from urllib.parse import urlparse

import requests

from lightning_dagster.registry.errors import RegistryUnavailable

# Telemetry is a network call; this project talks only to its own servers.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow's default (7 retries, backoff 2) hangs on a dead server for minutes: fail fast, reconcile later.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

# A classic ML experiment in MLflow 3, not GenAI development, which the UI assumes without the tag.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"

_initialised: set[str] = set()


def sqlite_path(uri: str) -> Path | None:
    if not uri.startswith("sqlite:"):
        return None
    path = uri.split(":///", 1)[1] if ":///" in uri else ""
    if not path.startswith("/"):
        raise ValueError(f"SQLite tracking URI must name an absolute path (sqlite:////abs/file.db): {uri!r}")
    return Path(path)


def is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def ensure_tracking_store(uri: str) -> None:
    """Create a SQLite store's schema once (safe from many processes); probe an HTTP server's health."""
    if uri in _initialised:
        return
    db = sqlite_path(uri)
    if db is not None:
        db.parent.mkdir(parents=True, exist_ok=True)
        with open(db.with_name(db.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                # Constructing both SQL stores runs the migrations of the tracking and registry schemas.
                from mlflow.store.model_registry.sqlalchemy_store import SqlAlchemyStore as RegistryStore
                from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore as TrackingStore

                TrackingStore(uri, db.parent.as_uri())
                RegistryStore(uri)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    elif is_http(uri):
        probe(uri)
    _initialised.add(uri)


def probe(uri: str, timeout: float = 3.0) -> None:
    """`RegistryUnavailable` at once if a server does not answer `/health` (MLflow retries for minutes)."""
    if not is_http(uri):
        return
    try:
        response = requests.get(uri.rstrip("/") + "/health", timeout=timeout)
    except requests.RequestException as exc:
        raise RegistryUnavailable(uri, f"{type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise RegistryUnavailable(uri, f"/health answered HTTP {response.status_code}")
