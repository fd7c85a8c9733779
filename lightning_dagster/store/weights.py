"""The fleet's weight versions: the policy versions a trainer publishes (a hash-chained document) and what
each serving process reports it serves (a flag per process, refreshed as a heartbeat)."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

import sqlalchemy as sa
from pydantic import BaseModel, ConfigDict

from lightning_dagster.store import schema
from lightning_dagster.store.connection import nonempty_text
from lightning_dagster.store.documents import DocumentStore
from lightning_dagster.types import now

POLICY_COLLECTION, POLICY_DOC = "policy_versions", "fleet"
SERVING_PREFIX = "serving/"
# A serving process reports at least this often; one silent for LIVE_WITHIN_S is presumed dead.
REPORT_EVERY_S = 1.0
LIVE_WITHIN_S = 10.0

ServingState = Literal["serving", "loading", "failed", "stopped"]


class PolicyVersion(BaseModel):
    """One published policy: `version` counts from 1; `path`, a checkpoint every server can read."""

    model_config = ConfigDict(frozen=True)

    version: int
    resource_id: str
    path: str
    weights_hash: str
    published_at: float


class ServingReport(BaseModel):
    """What one serving process serves (`failed`: it could not load `target`, see `error`)."""

    replica_id: str
    state: ServingState = "serving"
    version: int | None = None
    resource_id: str | None = None
    weights_hash: str | None = None
    target: int | None = None  # the version it is loading or failed to load
    error: str | None = None
    host: str = ""
    pid: int = 0
    updated_at: float = 0.0


class WeightVersions(DocumentStore):
    def publish_policy(self, resource_id: str, path: str, weights_hash: str) -> PolicyVersion:
        """Append the next policy version. Concurrent publishers: one wins, the other gets `Conflict`."""
        for name, value in (("resource_id", resource_id), ("path", path), ("weights_hash", weights_hash)):
            nonempty_text(name, value)
        head = self._policy_head()
        version = head.body["version"] + 1 if head else 1
        body = PolicyVersion(
            version=version, resource_id=resource_id, path=path, weights_hash=weights_hash, published_at=now()
        ).model_dump()
        previous = head.content_hash if head else None
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        self.append_document(POLICY_COLLECTION, POLICY_DOC, digest, body, previous)
        return PolicyVersion.model_validate(body)

    def _policy_head(self) -> sa.Row | None:
        d = schema.documents.c
        query = (
            sa.select(d.body, d.content_hash)
            .where(d.collection == POLICY_COLLECTION, d.doc_id == POLICY_DOC)
            .order_by(d.version.desc())
            .limit(1)
        )
        with self.engine.connect() as c:
            return c.execute(query).first()

    def published_policy(self) -> PolicyVersion | None:
        """The newest published version (one indexed read), or None before the first publication."""
        head = self._policy_head()
        return PolicyVersion.model_validate(head.body) if head else None

    def report_serving(self, report: ServingReport) -> None:
        nonempty_text("replica_id", report.replica_id)
        self.set_flag(SERVING_PREFIX + report.replica_id, report.model_dump(exclude={"updated_at"}))

    def serving_processes(self, live_within_s: float = LIVE_WITHIN_S) -> list[ServingReport]:
        """The live serving processes: reported within `live_within_s` and not stopped."""
        f = schema.flags.c
        query = sa.select(f.value, f.updated_at).where(
            f.key.startswith(SERVING_PREFIX, autoescape=True), f.updated_at >= now() - live_within_s
        )
        with self.engine.connect() as c:
            rows = c.execute(query.order_by(f.key)).all()
        reports = [ServingReport.model_validate({**r.value, "updated_at": r.updated_at}) for r in rows]
        return [r for r in reports if r.state != "stopped"]

    def fleet_version(self, live_within_s: float = LIVE_WITHIN_S) -> int | None:
        """The version every live serving process serves, else None: tagged rollouts start only at it."""
        live = self.serving_processes(live_within_s)
        versions = {r.version if r.state == "serving" else None for r in live}
        return versions.pop() if len(versions) == 1 else None
