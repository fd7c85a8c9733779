"""Shared fixtures: a real PostgreSQL server for the session, a fresh database per test."""

from __future__ import annotations

import os

import pytest

from tests.support.postgres import PostgresServer

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def postgres_server():
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A SQLAlchemy URL (postgresql+psycopg2) to a new, empty database on the session's server."""
    return postgres_server.url(postgres_server.create_database())
