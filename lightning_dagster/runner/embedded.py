"""An embedded gateway serving the local model, for runs that are not pointed at a running gateway."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lightning_dagster.store import Store
from lightning_dagster.types import Resource


@dataclass(frozen=True)
class EmbeddedGateway:
    url: str
    secret: str
    admin_key: str
    resource_id: str


def model_resource(store: Store, model_dir: Path) -> Resource:
    """The store's resource for `model_dir` with these exact weights, registered on first use."""
    from lightning_dagster.engine import checkpoint_hash

    weights = checkpoint_hash(model_dir)
    uri = str(model_dir.resolve())
    for resource in store.list_resources():
        if resource.uri == uri and resource.weights_hash == weights:
            return resource
    return store.add_resource(Resource(kind="model", uri=uri, weights_hash=weights))


@contextlib.contextmanager
def embedded_gateway(
    store: Store, model_dir: Path, *, build_if_missing: bool = True
) -> Iterator[EmbeddedGateway]:
    """Load `model_dir` (building the base model there first if absent) and serve it on 127.0.0.1."""
    # Imported here: torch and the web stack cost seconds, and only this path needs them.
    from lightning_dagster.engine import BatchingEngine, Engine, build_base_model
    from lightning_dagster.gateway import EngineBackend, GatewayServer, create_app

    if not (model_dir / "config.json").exists():
        if not build_if_missing:
            raise FileNotFoundError(f"no model at {model_dir}")
        build_base_model(model_dir)
    resource = model_resource(store, model_dir)
    engine = BatchingEngine(Engine(model_dir))
    secret, admin_key = secrets.token_hex(32), secrets.token_hex(32)
    app = create_app(store, EngineBackend(engine, resource.resource_id), secret=secret, admin_key=admin_key)
    server = GatewayServer(app)
    server.start()
    try:
        yield EmbeddedGateway(server.url, secret, admin_key, resource.resource_id)
    finally:
        server.stop()
        engine.close()
