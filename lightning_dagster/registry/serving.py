"""Prove a checkpoint serves: load it with the embedded engine, put a gateway in front, ask one question.

Rollback and the rollback drill share this one probe. It runs a temporary gateway over a scratch store so
that the probe's span never lands among real serve rollouts (which the continual-learning sensor counts).
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path


def serve_once(
    checkpoint_dir: Path, *, on_loaded: Callable[[], None] | None = None, timeout: float = 60.0
) -> str:
    """Load `checkpoint_dir`, serve it on 127.0.0.1, make one chat completion, return the reply text.

    `on_loaded` is called once the engine holds the weights, so a caller can tell "did not load" from "did
    not serve". Any failure raises."""
    import openai

    from lightning_dagster.engine import BatchingEngine, Engine
    from lightning_dagster.gateway import EngineBackend, GatewayServer, create_app
    from lightning_dagster.store import Store

    engine = Engine(Path(checkpoint_dir))
    if on_loaded is not None:
        on_loaded()
    batching = BatchingEngine(engine, max_batch=1)
    key = secrets.token_hex(16)
    try:
        with tempfile.TemporaryDirectory(prefix="ld-serve-probe-") as tmp:
            scratch = Store(f"sqlite:///{Path(tmp) / 'probe.db'}")
            app = create_app(
                scratch,
                EngineBackend(batching, resource_id=None),
                secret=secrets.token_hex(16),
                admin_key=secrets.token_hex(16),
                serve_keys=[key],
            )
            with GatewayServer(app) as server:
                client = openai.OpenAI(
                    base_url=f"{server.url}/v1", api_key=key, timeout=timeout, max_retries=0
                )
                reply = client.chat.completions.create(
                    model=Path(checkpoint_dir).name,
                    messages=[{"role": "user", "content": "What is 2 + 3?"}],
                    max_tokens=8,
                    temperature=0.0,
                    seed=0,
                )
            scratch.engine.dispose()
    finally:
        batching.close()
    if not reply.choices:
        raise RuntimeError("the gateway answered with no choices")
    return reply.choices[0].message.content or ""
