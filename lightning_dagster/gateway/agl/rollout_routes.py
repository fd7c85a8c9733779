"""`/api/rollouts...`: Agent Lightning's rollout routes over our store (`store.agl`). Plain Starlette routes
reading their body with pydantic_core: these are the calls a controller polls with."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any, Literal

import anyio
from cachetools import LRUCache
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from lightning_dagster.gateway import schemas
from lightning_dagster.gateway.agl import WORKER_ID, Agl, reply, validated
from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.store import agl_rollouts as store_agl

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
    # no "/": the rollout's routes take its id as one path segment, so it could never be read back
    rollout_id: str | None = Field(None, min_length=1, max_length=64, pattern=r"^[^/]+$")


class StatusPatch(_Strict):
    state: Literal["queuing", "running", "succeeded", "failed"] | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class RolloutPatch(_Strict):
    status: StatusPatch | None = None


CREATE = TypeAdapter(list[RolloutCreate])
PATCH = TypeAdapter(RolloutPatch)


def as_agl(r: store_agl.AglRow) -> dict[str, Any]:
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


def _int(request: Request, name: str, default: int) -> int:
    value = request.query_params.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise GatewayError(422, f"{name}: expected an integer, got {value!r}", param=name) from None
    if not -(2**63) <= number < 2**63:  # what the database's integers hold
        raise GatewayError(422, f"{name}: {value} is outside the 64-bit integer range", param=name)
    return number


class Rendered:
    """Each rollout's JSON, kept while its status, version and creation stay (a controller polls the same
    ones; a deleted id created again, maybe through another replica, is another rollout)."""

    def __init__(self) -> None:
        self.cache: LRUCache[str, tuple[tuple, bytes]] = LRUCache(10_000)

    def one(self, row: store_agl.AglRow) -> bytes:
        version = row.metadata.get("agl", {}).get("status", {}).get("version", 1)
        hit, stamp = self.cache.get(row.rollout_id), (row.status, version, row.created_at)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        body = schemas.dumps(as_agl(row))
        self.cache[row.rollout_id] = (stamp, body)
        return body

    def many(self, store, keys: list[tuple[str, str, int, float]]) -> bytes:
        """A JSON list of the rollouts `keys` name (id and stamp), reading only the changed ones."""
        parts = {}
        for rid, *stamp in keys:
            hit = self.cache.get(rid)
            if hit is not None and hit[0] == tuple(stamp):
                parts[rid] = hit[1]
        missing = [k[0] for k in keys if k[0] not in parts]
        for row in store_agl.get_many(store, missing) if missing else ():
            parts[row.rollout_id] = self.one(row)
        return b"[" + b",".join(parts[k[0]] for k in keys if k[0] in parts) + b"]"


def routes(app: FastAPI, gw: Gateway, agl: Agl) -> list[tuple[str, Any, str]]:
    """(path, endpoint, method) of this module's routes."""
    store = gw.store
    rendered = Rendered()
    sampling = {True: agl.settings.train.model_dump(), False: agl.settings.val.model_dump()}

    run = anyio.to_thread.run_sync

    async def read(fn, *args):
        """Plain sqlite3 reads of a WAL file never wait for writers: cheaper here than a thread hop."""
        return fn(*args) if store.raw_reads else await run(fn, *args)

    async def create(request: Request) -> Response:
        agl.check(request)
        items = validated(CREATE, await gw.body(request))
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
        # a free write lock: committed here without an fsync, saving two thread hand-offs
        made = store_agl.create(store, fresh, nowait=True) or await run(store_agl.create, store, fresh)
        return reply(b"[" + b",".join(rendered.one(r) for r in made) + b"]", 201)

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
        keys = await read(store_agl.query, store, states, max(limit, 0))
        return reply(await read(rendered.many, store, keys))

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

        def both() -> tuple[store_agl.AglRow, list[str]]:
            return store_agl.get(store, rid), [str(i) for i in range(len(store_agl.attempt_ids(store, rid)))]

        rollout, names = await read(both)
        return reply(b'{"rollout":' + rendered.one(rollout) + b',"attempts":' + schemas.dumps(names) + b"}")

    async def patch(request: Request) -> Response:
        agl.check(request)
        rid = request.path_params["rollout_id"]
        body = validated(PATCH, await gw.body(request))
        fields = body.status.model_dump(exclude_unset=True) if body.status is not None else {}
        if not fields:
            return reply(rendered.one(await read(store_agl.get, store, rid)))
        worker = fields.get("k8s_job_name") or WORKER_ID
        moved = await run(store_agl.move, store, rid, fields, worker)
        if "state" in fields:  # an ended attempt's context re-reads its state now, not after `state_ttl_s`
            gw.attempts.changed([t.attempt_id for t in (agl.targets.get(rid) or {}).values()])
        agl.moved(rid)
        return reply(rendered.one(moved))

    async def delete(request: Request) -> Response:
        agl.check(request)
        rid = request.path_params["rollout_id"]
        attempts = await run(store_agl.delete, store, rid)
        agl.moved(rid)  # its cached attempts would still take events and proxied calls
        rendered.cache.pop(rid, None)  # the id may be created again, at the same status and version
        # and their contexts calls by attempt key (a file store's are never read again while cached); other
        # replicas (PostgreSQL) see the delete in the attempt read every call makes there (`gateway.attempts`)
        gw.attempts.changed(attempts, deleted=True)
        return Response(status_code=204)

    return [
        ("/api/rollouts", create, "POST"),
        ("/api/rollouts", listing, "GET"),
        ("/api/rollouts/terminal", terminal, "GET"),
        ("/api/rollouts/{rollout_id}", one, "GET"),
        ("/api/rollouts/{rollout_id}", patch, "PATCH"),
        ("/api/rollouts/{rollout_id}", delete, "DELETE"),
    ]
