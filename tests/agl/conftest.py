"""Fixtures: the gateway with the Agent Lightning surface over a SQLite store file or a PostgreSQL database,
forwarding to the stub upstream, and an httpx client holding the server key."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from lightning_dagster.gateway import GatewayKeys, GatewayOptions, GatewayServer, UpstreamBackend, create_app
from lightning_dagster.store import Store
from tests.support.stub_upstream import create_stub_app

KEY = "agl-server-key-0123456789"
SECRET = "test-secret-0123456789"
ADMIN = "admin-key-abcdefghijkl"
TRAIN_T, VAL_T = 0.9, 0.3


@dataclass
class Agl:
    url: str
    store: Store
    api: httpx.Client

    def create(self, *items: dict) -> list[dict]:
        r = self.api.post("/api/rollouts", json=list(items))
        assert r.status_code == 201, r.text
        return r.json()

    def patch(self, rollout_id: str, **status) -> httpx.Response:
        return self.api.patch(f"/api/rollouts/{rollout_id}", json={"status": status})

    def proxy(self, rollout_id: str, mode: str = "train", path: str = "chat/completions") -> str:
        return f"/proxy/rollout/{rollout_id}/attempt/0/mode/{mode}/openai/v1/{path}"


@pytest.fixture(scope="session")
def stub():
    with GatewayServer(create_stub_app(reply_tokens=8)) as server:
        yield server


@pytest.fixture(scope="session")
def refusing():
    """An upstream that refuses every call with a 400, as vLLM does for a prompt over its context."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> JSONResponse:
        return JSONResponse({"error": {"message": "prompt too long"}}, status_code=400)

    with GatewayServer(app) as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def agl(request, tmp_path, stub):
    """The surface over each durable store: a SQLite file, and a database on a real PostgreSQL server."""
    if request.param == "postgresql":
        store = Store(request.getfixturevalue("postgres_url"))
    else:
        store = Store(f"sqlite:///{tmp_path / 'store.db'}")
    options = GatewayOptions(state_ttl_s=0.0, agl_train_temperature=TRAIN_T, agl_val_temperature=VAL_T)
    backend = UpstreamBackend(stub.url, model="stub-model")
    app = create_app(store, backend, keys=GatewayKeys(SECRET, ADMIN, agl_key=KEY), options=options)
    with (
        GatewayServer(app) as server,
        httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as api,
    ):
        yield Agl(server.url, store, api)
    store.close()
