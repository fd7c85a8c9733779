"""Agent Lightning v1.0's server surface (`agl-server`'s REST API, proxy paths and management routes) served
by the gateway from the durable store, so its controller, trainer client and agents run against us unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import pydantic
from cachetools import LRUCache
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.keys import attempt_key, request_key, same_key
from lightning_dagster.gateway.schemas import parse_json
from lightning_dagster.store import agl_rollouts as store_agl
from lightning_dagster.types import Sampling

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway

WORKER_ID = "agl"  # the worker our attempts record when Agent Lightning's controller starts them


@dataclass(frozen=True)
class AglSettings:
    """The server key and the sampling of each proxy mode (kept in each rollout's `metadata["sampling"]` at
    creation: `train` for `is_train`, else `val`)."""

    key: str
    train: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))
    val: Sampling = field(default_factory=lambda: Sampling(temperature=1.0))

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("the Agent Lightning server key must not be empty")


@dataclass(frozen=True)
class Target:
    """The attempt an Agent Lightning path names (`name`: "0" first): our id, the rollout's mode, its key."""

    name: str
    attempt_id: str
    mode: str  # train | val
    key: str


class Agl:
    """What the Agent Lightning routes share: the settings, the server key check and the attempts their
    paths name (cached per rollout; a move or delete drops the rollout's entries, and a lookup under way
    meanwhile is not cached). Another replica's move or delete leaves this cache as it was, which is safe:
    every event and proxied call takes the attempt's context, which re-reads its state there, and a name
    never changes its attempt once resolved."""

    def __init__(self, settings: AglSettings, secret: str):
        self.settings = settings
        self.secret = secret
        self.targets: LRUCache[str, dict[str, Target]] = LRUCache(10_000)  # rollouts

    def check(self, request: Request) -> None:
        """401 unless the request carries the server key."""
        key = request_key(request)
        if not key:
            raise GatewayError(401, "missing API key (Authorization: Bearer <key> or x-api-key)")
        if not self.is_server_key(key):
            raise GatewayError(401, "invalid API key")

    def is_server_key(self, key: str) -> bool:
        return same_key(key, self.settings.key)

    def moved(self, rollout_id: str) -> None:
        """The rollout moved or was deleted: its attempts are no longer resolved from the cache."""
        self.targets.pop(rollout_id, None)

    async def target(self, store, rollout_id: str, attempt_id: str) -> Target:
        """The attempt Agent Lightning names `attempt_id` ("0" the first; a queuing rollout's starts now)."""
        known = self.targets.get(rollout_id)
        if known is None:
            known = self.targets[rollout_id] = {}
        found = known.get(attempt_id)
        if found is None:

            def resolve() -> Target:
                rollout = store_agl.get(store, rollout_id)
                aid = store_agl.named_attempt(store, rollout_id, attempt_id, WORKER_ID).attempt_id
                mode = "train" if rollout.metadata.get("agl", {}).get("is_train", True) else "val"
                return Target(attempt_id, aid, mode, attempt_key(self.secret, rollout_id, aid))

            try:
                found = await anyio.to_thread.run_sync(resolve)
            except BaseException:
                if not known and self.targets.get(rollout_id) is known:  # an unknown id leaves no entry
                    self.targets.pop(rollout_id, None)
                raise
            if self.targets.get(rollout_id) is known:  # no move or delete of the rollout meanwhile
                known[attempt_id] = found
        return found


def validated(adapter: pydantic.TypeAdapter, raw: bytes) -> Any:
    """The JSON body validated; else a 422 naming the first invalid field (`0.rollout_id`; `body`)."""
    return schemas.check(adapter, parse_json(raw))


def reply(body: object, status: int = 200) -> Response:
    """`body` as JSON (bytes: already JSON)."""
    raw = body if isinstance(body, bytes) else schemas.dumps(body)
    return Response(raw, status_code=status, media_type="application/json")


def mount(app: FastAPI, gw: Gateway, settings: AglSettings) -> None:
    """Serve the surface as routes of the app: `/healthz` (no key) and, behind the server key, those of
    `rollout_routes`, `events` and `proxy`."""
    from lightning_dagster.gateway.agl import events, proxy, rollout_routes

    async def healthz(request: Request) -> Response:
        return reply({"status": "ok"})

    agl = Agl(settings, gw.attempts.secret)
    app.add_route("/healthz", healthz, methods=["GET"])
    for module in (rollout_routes, events, proxy):
        for path, endpoint, method in module.routes(app, gw, agl):
            app.add_route(path, endpoint, methods=[method])
