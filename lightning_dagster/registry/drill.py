"""The rollback drill: prove a version still resolves, verifies, loads and serves; no pointer moves."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lightning_dagster.gate.hashing import content_hash
from lightning_dagster.gate.receipt import RollbackDrill
from lightning_dagster.registry.errors import RegistryUnavailable
from lightning_dagster.store.documents import append_chained

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry
    from lightning_dagster.settings import ServingSettings

DRILL_ENVIRONMENT = "separate gateway on 127.0.0.1 (registry.rollback_drill)"
DRILLS = "rollback_drills"


@dataclass
class DrillResult:
    """What a rollback drill proved, step by step; `error` says why the first failed step failed."""

    version: str
    resolved: bool = False
    hash_ok: bool = False
    loaded: bool = False
    served: bool = False
    seconds: float = 0.0
    weights_hash: str | None = None
    reply: str | None = None
    error: str | None = None
    unavailable: bool = False  # MLflow could not be reached: evidence missing, not a failed parent
    engine: str = "embedded"  # what served the parent (`serving.engine`)
    at: float = field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.resolved and self.hash_ok and self.loaded and self.served

    def to_receipt_drill(self, parent_id: str, environment: str | None = None) -> RollbackDrill:
        """The receipt's `RollbackDrill`: a step not reached is None (unavailable), one that failed False."""

        def step(done: bool, tried: bool) -> bool | None:
            return True if done else (False if tried and not self.unavailable else None)

        verified = self.resolved and self.hash_ok
        return RollbackDrill(
            parent_id=parent_id,
            environment=environment
            or DRILL_ENVIRONMENT + ("" if self.engine == "embedded" else f", {self.engine}"),
            resolved=step(verified, True),
            loaded=step(self.loaded, verified),
            routed_back=step(self.served, self.loaded),
            at=self.at,
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def rollback_drill(
    reg: Registry, parent_version: str, *, record: bool = True, serving: ServingSettings | None = None
) -> DrillResult:
    """Resolve, verify, load and serve `parent_version` in a temporary gateway; failures are not raised."""
    from lightning_dagster.registry.approved import serve_once

    result = DrillResult(version=str(parent_version), engine=serving.engine if serving else "embedded")
    start = time.perf_counter()
    try:
        reg.connect()
        reg.verified().require()  # a drill on a pointer whose history does not verify proves nothing
        version = reg.model_version(str(parent_version))
        result.resolved = True
        result.weights_hash = version.weights_hash
        path = reg.fetch(version)
        result.hash_ok = True
        loaded = lambda: setattr(result, "loaded", True)  # noqa: E731
        result.reply = serve_once(path, on_loaded=loaded, serving=serving)
        result.served = True
    except Exception as exc:  # the drill reports; it does not raise
        result.error = f"{type(exc).__name__}: {exc}"
        result.unavailable = isinstance(exc, RegistryUnavailable)
    result.seconds = round(time.perf_counter() - start, 3)
    if record:
        record_drill(reg.store, reg.model_name, result.to_dict())
    return result


def record_drill(store: Any, model_name: str, result: Mapping[str, Any]) -> int:
    doc_id = f"{model_name}/{result['version']}"
    body = dict(result)
    digest = lambda previous: content_hash({"previous": previous, "drill": body})  # noqa: E731
    return append_chained(store, DRILLS, doc_id, body, digest, attempts=1)
