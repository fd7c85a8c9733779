"""The admin routes (`/admin/...`), all behind the admin key: 401 without a valid key, 403 with another."""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.keys import attempt_key
from lightning_dagster.gateway.weightsync import load_into, read_weights

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway


def admin_router(gw: Gateway) -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(gw.attempts.require_admin)])
    backend = gw.backend

    @router.get("/health")
    async def health() -> dict:
        contexts = len(gw.attempts.contexts)
        return {"status": "ok", "backend": backend.kind, "model": backend.model, "attempts": contexts}

    @router.get("/stats")
    async def stats() -> dict:
        batching = getattr(backend, "batching", None)  # the embedded engine's occupancy counters
        return {"token_in": gw.stats.as_dict(), **({"engine": batching.counters()} if batching else {})}

    @router.get("/attempts/{attempt_id}/stats")
    async def attempt_stats(attempt_id: str) -> dict:
        ctx = gw.attempts.contexts.get(attempt_id)
        if ctx is None:
            raise GatewayError(404, f"no calls seen for attempt {attempt_id} since the gateway started")
        return {"rollout_id": ctx.rollout_id, "attempt_id": attempt_id, "token_in": ctx.stats.as_dict()}

    @router.get("/attempts/{attempt_id}/spans")
    async def attempt_spans(attempt_id: str) -> Response:
        await gw.writer.write([])  # barrier: spans acknowledged before this request are committed
        spans = await anyio.to_thread.run_sync(lambda: gw.store.list_spans(attempt_id=attempt_id))
        return Response(
            schemas.dumps([s.model_dump(mode="json") for s in spans]), media_type="application/json"
        )

    @router.post("/weights")
    async def load_weights(request: Request) -> dict:
        """A trainer in another process pushes its new policy as a file read here (under the model roots,
        403 otherwise), through the weight gate: calls sampled after this returns use the new weights."""
        req = schemas.validate(schemas.WeightsRequest, await gw.body(request))
        if not backend.loads_weights:
            raise GatewayError(
                409, f"a {backend.kind} backend cannot load weights; push them to the server it calls"
            )
        path = gw.weights_file(req.path)
        served = await gw.weights.swap(lambda: load_into(backend, read_weights(path), req.resource_id))
        return {
            "status": "ok",
            "model": backend.model,
            "resource_id": served.resource_id,
            "weights": served.attributes(),
        }

    @router.post("/weights/verify")
    async def verify_weights() -> dict:
        """409 unless the engine still serves the weights the gate last verified (the runner asks)."""
        served = gw.weights.current
        await anyio.to_thread.run_sync(backend.verify, served.weights_hash)
        return {"status": "ok", "model": backend.model, "weights": served.attributes()}

    @router.get("/weights")
    async def weights_state() -> dict:
        """The weight gate's state and this process's fleet report (None without weight sync)."""
        report = gw.sync.report.model_dump() if gw.sync is not None else None
        return {**gw.weights.state(), "fleet": report}

    @router.post("/keys")
    async def mint_key(request: Request) -> dict:
        req = schemas.validate(schemas.KeyRequest, await gw.body(request))
        return {"key": attempt_key(gw.attempts.secret, req.rollout_id, req.attempt_id)}

    return router
