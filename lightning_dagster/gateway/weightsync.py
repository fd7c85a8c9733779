"""Weights a serving process samples from, exactly per call: the gate that swaps them (`WeightGate`), and the
fleet protocol that moves every replica to each policy version a trainer publishes (`publish`, `WeightSync`).

Fleet protocol (docs/CONTRACTS.md, gateway): the trainer publishes version V (resource id, checkpoint, its
hash); every replica's `WeightSync` sees it within `poll_s`, checks the hash, swaps and reports serving V.
Runners claim a rollout tagged `metadata["policy_version"] = V` only while every live replica reports V, and
a tagged call on another version is refused (503 while behind, after `wait_s`; 409 once newer).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.store.weights import REPORT_EVERY_S, PolicyVersion, ServingReport

if TYPE_CHECKING:
    import torch

    from lightning_dagster.gateway.app import Gateway

log = logging.getLogger(__name__)
RETRY_FAILED_S = 5.0  # a version that failed to load (e.g. not yet visible on a shared disk) is retried


@dataclass(frozen=True)
class ServedWeights:
    """The weights a call sampled from: the published `version` (None: not a published version, e.g. the
    starting checkpoint or a direct push), the `resource_id` and the `weights_hash` (`checkpoint_hash`)."""

    version: int | None
    resource_id: str | None
    weights_hash: str | None

    def attributes(self) -> dict[str, Any]:
        return {"version": self.version, "hash": self.weights_hash, "resource_id": self.resource_id}


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file, or of every safetensors file in a checkpoint directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise GatewayError(400, f"cannot read weights from {str(path)!r}: no safetensors files", param="path")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (OSError, SafetensorError) as exc:
            raise GatewayError(400, f"cannot read weights from {str(f)!r}: {exc}", param="path") from exc
    return state


def load_into(
    backend, state: dict, resource_id: str | None, published: PolicyVersion | None = None
) -> ServedWeights:
    """Blocking: `backend` serves `state`, hashed (with a `published` version: refused unless it is that)."""
    from lightning_dagster.engine.build import tensors_hash

    digest = tensors_hash(state)
    if published is not None and digest != published.weights_hash:
        raise GatewayError(409, f"{published.path}: weights hash {digest} is not the published one")
    backend.load_weights(state, resource_id)
    return ServedWeights(published.version if published is not None else None, resource_id, digest)


def publish(store, checkpoint: Path | str, resource_id: str) -> PolicyVersion:
    """The trainer's side: publish `checkpoint` (readable by every replica) as the next policy version."""
    from lightning_dagster.engine.build import checkpoint_hash

    path = Path(checkpoint).resolve()
    return store.publish_policy(resource_id, str(path), checkpoint_hash(path))


class WeightGate:
    """Pause, drain, swap, resume. Every LLM call holds the gate while it samples (`enter` / `leave`), so a
    call records exactly the weights it sampled from. Calls arriving while paused wait up to `wait_s`."""

    def __init__(self, current: ServedWeights, *, wait_s: float = 30.0) -> None:
        self.current = current
        self.wait_s = wait_s
        self.in_flight = 0
        self.paused: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Future | None = None
        self._swap: asyncio.Lock | None = None

    def bind(self) -> None:
        """Attach to the running event loop (the app's, at startup)."""
        self._loop = asyncio.get_running_loop()
        self._changed = self._loop.create_future()
        self._swap = asyncio.Lock()

    def _notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
            self._changed = self._loop.create_future()

    async def _wait_change(self, timeout: float) -> None:
        if self._changed is None:
            self.bind()
        await asyncio.wait_for(asyncio.shield(self._changed), timeout)

    async def enter(self, required: int | None = None) -> ServedWeights:
        """Start a call; returns the weights it samples from. `required`: the policy version its rollout is
        tagged with (409 if this process already serves a newer one, 503 if it is not loaded in time)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            version = self.current.version
            if not self.paused:
                if required is None or version == required:
                    self.in_flight += 1
                    return self.current
                if version is not None and version > required:
                    raise GatewayError(
                        409,
                        f"the rollout is tagged with policy version {required}; this gateway serves the newer "
                        f"version {version}",
                        code="weights_superseded",
                    )
            try:  # past the deadline, wait_for times out at once
                await self._wait_change(deadline - time.monotonic())
            except TimeoutError:
                why = f"paused ({', '.join(sorted(self.paused))})" if self.paused else f"serving {version}"
                raise GatewayError(
                    503,
                    f"policy version {required} is not loaded here yet ({why}); retry"
                    if required is not None
                    else f"the gateway is {why}; retry",
                    code="weights_loading",
                ) from None

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self.paused:
            self._notify()

    async def swap(self, load: Callable[[], ServedWeights]) -> ServedWeights:
        """Pause, drain, run the blocking `load` (returning what now serves) off the loop, resume. One swap at
        a time; if `load` raises, the old weights keep serving."""
        if self._swap is None:
            self.bind()
        async with self._swap:
            self.paused.add("weights")
            try:
                while self.in_flight:  # drain: new calls wait while paused
                    await self._wait_change(3600)
                self.current = await anyio.to_thread.run_sync(load)
            finally:
                self.paused.discard("weights")
                self._notify()
        return self.current

    def swap_from_thread(self, load: Callable[[], ServedWeights]) -> ServedWeights:
        """`swap` for a caller outside the event loop (an in-process trainer's push)."""
        if self._loop is None:  # not serving yet: no call can be in flight
            self.current = load()
            return self.current
        return asyncio.run_coroutine_threadsafe(self.swap(load), self._loop).result()

    def state(self) -> dict[str, Any]:
        return {
            "paused": sorted(self.paused),
            "in_flight": self.in_flight,
            "weights": self.current.attributes(),
        }


class WeightSync:
    """One serving process's side of the fleet protocol: polls every `poll_s`, loads a newer version through
    the gate, and reports what it serves at least every `REPORT_EVERY_S`."""

    def __init__(self, gw: Gateway, *, poll_s: float = 0.5) -> None:
        self.gw = gw
        self.poll_s = poll_s
        host, pid = socket.gethostname(), os.getpid()
        self.report = ServingReport(replica_id=f"{host}-{pid}-{uuid.uuid4().hex[:6]}", host=host, pid=pid)
        self.applied = 0  # the newest published version loaded (a direct push does not change it)
        self._reported_at = 0.0
        self._failed: tuple[int, float] | None = None  # (version, monotonic time) of the last failed load

    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - a store hiccup: report again next round
                log.exception("weight sync round failed")
            await asyncio.sleep(self.poll_s)

    async def tick(self) -> None:
        published = await anyio.to_thread.run_sync(self.gw.store.published_policy)
        if published is not None and published.version > self.applied and self._due(published):
            await self.load(published)
        elif time.monotonic() - self._reported_at >= REPORT_EVERY_S:
            await self._send(state=self.report.state)

    def _due(self, published: PolicyVersion) -> bool:
        failed = self._failed
        return (
            failed is None or failed[0] != published.version or time.monotonic() - failed[1] > RETRY_FAILED_S
        )

    async def load(self, published: PolicyVersion) -> None:
        await self._send(state="loading", target=published.version, error=None)

        def load() -> ServedWeights:
            state = read_weights(self.gw.weights_file(published.path))
            return load_into(self.gw.backend, state, published.resource_id, published)

        try:
            await self.gw.weights.swap(load)
        except GatewayError as exc:
            self._failed = (published.version, time.monotonic())
            log.error("policy version %d not loaded: %s", published.version, exc.message)
            await self._send(state="failed", target=published.version, error=exc.message[:500])
            return
        self._failed, self.applied = None, published.version
        await self._send(state="serving", target=None, error=None)

    async def _send(self, **changes: Any) -> None:
        served = dataclasses.asdict(self.gw.weights.current)  # what serves now, whoever loaded it
        self.report = self.report.model_copy(update={**changes, **served})
        await anyio.to_thread.run_sync(self.gw.store.report_serving, self.report)
        self._reported_at = time.monotonic()

    async def stop(self) -> None:
        await self._send(state="stopped")
