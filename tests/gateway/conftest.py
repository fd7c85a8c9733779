"""Fixtures: the real tiny model (built once per session), a scripted copy of it, a real Store per test,
a real GatewayServer over HTTP, and the stub upstream for upstream mode."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from lightning_dagster.engine import BatchingEngine, Engine, build_base_model
from lightning_dagster.gateway import (
    EngineBackend,
    GatewayKeys,
    GatewayOptions,
    GatewayServer,
    UpstreamBackend,
    attempt_key,
    create_app,
)
from lightning_dagster.harnesses.corpus import training_corpus
from lightning_dagster.store import Store
from lightning_dagster.types import Rollout, RolloutKind
from tests.gateway.scripted import script_weights, spell
from tests.support.stub_upstream import create_stub_app

SECRET = "test-secret-0123456789"
ADMIN = "admin-key-abcdefghijkl"
SERVE = "serve-key-mnopqrstuvwx"
SERVE2 = "serve-key-second-yz0123"
TOOL_CALL_TEXT = '<tool_call>{"name": "now"}</tool_call>'


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return build_base_model(
        tmp_path_factory.mktemp("gateway-model") / "base", corpus=training_corpus(seed=0), seed=0
    )


@pytest.fixture(scope="session")
def engine(model_dir) -> Engine:
    return Engine(model_dir)


@pytest.fixture(scope="session")
def batching(engine):
    b = BatchingEngine(engine, max_batch=16, max_wait_ms=5.0)
    yield b
    b.close()


@dataclass
class Script:
    drift: list[int]  # a spelling that decode -> encode turns into different ids
    ids: list[int]  # the whole scripted response, EOS excluded


@pytest.fixture(scope="session")
def scripted(model_dir):
    """An engine that greedily answers every chat turn with `bal` spelled b,a,l (which re-encodes as one
    merged token) followed by a tool call spelled with distinct, non-canonical tokens, then EOS."""
    eng = Engine(model_dir)
    word = next(
        s for s in (eng.decode([i]) for i in range(300, eng.vocab_size)) if s.isalpha() and len(s) >= 3
    )
    drift = [eng.encode(c)[0] for c in word]
    assert eng.encode(eng.decode(drift)) != drift
    start = eng.render([{"role": "user", "content": "x"}])[-1]
    avoid = {start, *eng.eos_token_ids, eng.pad_token_id, *drift, *eng.tokenizer.all_special_ids}
    ids = drift + spell(eng, TOOL_CALL_TEXT, avoid=avoid)
    eng.load_weights(script_weights(eng, start, ids, min(eng.eos_token_ids)))
    b = BatchingEngine(eng, max_batch=4, max_wait_ms=1.0)
    yield eng, b, Script(drift, ids)
    b.close()


@pytest.fixture
def store(tmp_path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'store.db'}")
    yield s
    s.close()


@dataclass
class Gateway:
    server: GatewayServer
    store: Store
    url: str

    def attempt(self, *, metadata: dict | None = None, kind: RolloutKind = RolloutKind.train):
        """A rollout with a running attempt; returns (rollout_id, attempt_id, key)."""
        (rollout,) = self.store.enqueue_rollouts([Rollout(kind=kind, metadata=metadata or {})])
        claimed = self.store.claim_rollout("test-worker", rollout_ids=[rollout.rollout_id])
        assert claimed is not None
        _, attempt = claimed
        return (
            rollout.rollout_id,
            attempt.attempt_id,
            attempt_key(SECRET, rollout.rollout_id, attempt.attempt_id),
        )

    def client(self, key: str, *, path: tuple[str, str] | None = None) -> openai.OpenAI:
        base = self.url if path is None else f"{self.url}/rollouts/{path[0]}/attempts/{path[1]}"
        return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)

    def spans(self, attempt_id: str, kind: str | None = "llm"):
        return self.store.list_spans(attempt_id=attempt_id, kind=kind)


def _serve(store, backend, **kw):
    keys = GatewayKeys(SECRET, ADMIN, serve_keys=(SERVE, SERVE2))
    app = create_app(store, backend, keys=keys, options=GatewayOptions(state_ttl_s=0.0, **kw))
    return GatewayServer(app)


@pytest.fixture
def gateway(store, batching):
    with _serve(store, EngineBackend(batching, resource_id="res-base")) as server:
        yield Gateway(server, store, server.url)


@pytest.fixture
def scripted_gateway(store, scripted):
    _, b, _ = scripted
    with _serve(store, EngineBackend(b, resource_id="res-scripted")) as server:
        yield Gateway(server, store, server.url)


@pytest.fixture
def small_gateway(store, batching):
    """Same as `gateway`, with a 2 KB body limit."""
    with _serve(store, EngineBackend(batching, resource_id="res-base"), max_body_bytes=2048) as server:
        yield Gateway(server, store, server.url)


@pytest.fixture(scope="session")
def stub():
    with GatewayServer(create_stub_app(reply_tokens=50)) as server:
        yield server


@pytest.fixture
def upstream_gateway(store, stub):
    app = create_app(store, UpstreamBackend(stub.url, model="stub-model"), keys=GatewayKeys(SECRET, ADMIN))
    with GatewayServer(app) as server:
        yield Gateway(server, store, server.url)
