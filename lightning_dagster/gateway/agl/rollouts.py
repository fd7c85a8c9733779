"""`/api/rollouts...`: Agent Lightning's rollout routes over our store (`store.agl`). Plain Starlette routes
reading their body with pydantic_core: these are the calls a controller polls with."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from lightning_dagster.gateway.agl import WORKER_ID, Agl, parse_json, reply
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.store import agl as store_agl
from lightning_dagster.types import Rollout

if TYPE_CHECKING:
    from lightning_dagster.gateway.app import Gateway

STATES = ("queuing", "running", "succeeded", "failed")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LocalConfig(_Strict):
    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class K8sConfig(_Strict):
    job_template: str | None = None


class RolloutConfig(_Strict):
    timeout_seconds: int = 3600
    local: LocalConfig | None = None
    k8s: K8sConfig | None = None


class RolloutCreate(_Strict):
    input: Any
    is_train: bool = True
    config: RolloutConfig | None = None
    metadata: dict[str, Any] | None = None
    rollout_id: str | None = Field(None, min_length=1, max_length=64)


class StatusPatch(_Strict):
    state: Literal["queuing", "running", "succeeded", "failed"] | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class RolloutPatch(_Strict):
    status: StatusPatch | None = None


CREATE = TypeAdapter(list[RolloutCreate])
PATCH = TypeAdapter(RolloutPatch)


def as_agl(r: Rollout) -> dict[str, Any]:
    """Agent Lightning's `Rollout` JSON for one of ours."""
    agl = r.metadata.get("agl", {})
    status = agl.get("status", {})
    return {
        "rollout_id": r.rollout_id,
        "input": r.task.get("input"),
        "is_train": agl.get("is_train", True),
        "config": agl.get("config", {}),
        "metadata": {"batch_idx": None, "sample_idx_in_batch": None, **agl.get("metadata", {})},
        "status": {
            "state": store_agl.AGL_STATE[r.status],
            "k8s_job_name": status.get("k8s_job_name"),
            "last_attempt_id": status.get("last_attempt_id"),
            "error_message": status.get("error_message"),
            "version": status.get("version", 1),
            "created_at": r.created_at,
            "updated_at": status.get("updated_at", r.created_at),
        },
    }


def _validated(adapter: TypeAdapter, raw: bytes) -> Any:
    try:
        return adapter.validate_python(parse_json(raw))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise GatewayError(422, f"{where}: {first['msg']}", param=where) from exc


def _int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise GatewayError(422, f"{name}: expected an integer, got {value!r}", param=name) from None


def mount(app: FastAPI, gw: Gateway, agl: Agl) -> None:
    store = gw.store
    sampling = {True: agl.settings.train.model_dump(), False: agl.settings.val.model_dump()}

    def run(fn, *args):
        return anyio.to_thread.run_sync(fn, *args)

    async def create(request: Request) -> Response:
        agl.check(request)
        items = _validated(CREATE, await gw.body(request))
        fresh = [
            store_agl.new_rollout(
                i.rollout_id or uuid.uuid4().hex,
                {
                    **i.model_dump(exclude={"rollout_id"}),
                    "config": (i.config or RolloutConfig()).model_dump(),
                },
                sampling[i.is_train],
            )
            for i in items
        ]
        made = await run(store_agl.create, store, fresh)
        return reply([as_agl(r) for r in made], 201)

    async def listing(request: Request) -> Response:
        agl.check(request)
        states = request.query_params.getlist("state_in")
        if not states:
            raise GatewayError(422, "state_in: at least one state is required", param="state_in")
        if bad := [s for s in states if s not in STATES]:
            raise GatewayError(
                422, f"state_in: {bad[0]!r} is not one of {', '.join(STATES)}", param="state_in"
            )
        limit = _int(request, "limit", 500)
        found = await run(store_agl.query, store, states, max(limit, 0))
        return reply([as_agl(r) for r in found])

    async def terminal(request: Request) -> Response:
        agl.check(request)
        after, limit = max(_int(request, "after", 0), 0), max(_int(request, "limit", 1000), 1)
        found, next_after, total = await run(store_agl.terminal_page, store, after, limit)
        items = [
            {
                "rollout_id": r.rollout_id,
                "state": store_agl.AGL_STATE[r.status],
                "data_id": r.task_id,
                "is_train": r.metadata.get("agl", {}).get("is_train", True),
            }
            for r in found
        ]
        return reply({"items": items, "next_after": next_after, "total_terminal": total})

    async def one(request: Request) -> Response:
        agl.check(request)
        rid = request.path_params["rollout_id"]

        def read() -> tuple[Rollout, list[str]]:
            return store_agl.get(store, rid), [a.attempt_id for a in store.list_attempts(rollout_id=rid)]

        rollout, attempts = await run(read)
        return reply({"rollout": as_agl(rollout), "attempts": attempts})

    async def patch(request: Request) -> Response:
        agl.check(request)
        rid = request.path_params["rollout_id"]
        body = _validated(PATCH, await gw.body(request))
        fields = body.status.model_dump(exclude_unset=True) if body.status is not None else {}
        if not fields:
            return reply(as_agl(await run(store_agl.get, store, rid)))
        worker = fields.get("k8s_job_name") or WORKER_ID
        moved = await run(store_agl.move, store, rid, fields, worker)
        agl.moved(rid)
        return reply(as_agl(moved))

    async def delete(request: Request) -> Response:
        agl.check(request)
        await run(store_agl.delete, store, request.path_params["rollout_id"])
        return Response(status_code=204)

    app.add_route("/api/rollouts", create, methods=["POST"])
    app.add_route("/api/rollouts", listing, methods=["GET"])
    app.add_route("/api/rollouts/terminal", terminal, methods=["GET"])
    app.add_route("/api/rollouts/{rollout_id}", one, methods=["GET"])
    app.add_route("/api/rollouts/{rollout_id}", patch, methods=["PATCH"])
    app.add_route("/api/rollouts/{rollout_id}", delete, methods=["DELETE"])
