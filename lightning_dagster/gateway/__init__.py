"""The OpenAI-compatible LLM gateway: per-attempt keys, exact token capture (token-out and token-in),
rewards, serve mode; backed by the embedded engine or an upstream OpenAI-compatible server."""

from lightning_dagster.gateway.app import create_app
from lightning_dagster.gateway.backends import Backend, Completion, EngineBackend
from lightning_dagster.gateway.keys import GatewayKeys, attempt_key
from lightning_dagster.gateway.options import GatewayOptions, gateway_options
from lightning_dagster.gateway.server import GatewayServer
from lightning_dagster.gateway.upstreams import UpstreamBackend, UpstreamPool

__all__ = [
    "Backend", "Completion", "EngineBackend", "GatewayKeys", "GatewayOptions", "GatewayServer",
    "UpstreamBackend", "UpstreamPool", "attempt_key", "create_app", "gateway_options",
]  # fmt: skip
