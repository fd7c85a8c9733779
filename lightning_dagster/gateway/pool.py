"""Gateway processes kept for the next stage of the same process: a process-mode gateway costs ~10 s to start
on 2 cores, and a pipeline run starts one per stage, each for a model of the same family. A stage that asks
for reuse (`LocalGateway(reuse=True)`) parks its child here when it closes; the next stage with the same
serving settings and model family takes it and pushes its own weights into it. Parked children are stopped
at interpreter exit, and exit with this process anyway (`--exit-with-parent`).
"""

from __future__ import annotations

import atexit
import hashlib
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_dagster.gateway.process import GatewayProcess

# Files of a checkpoint that hold weights: two checkpoints equal in everything else serve the same
# architecture, tokenizer and chat template, so one's gateway can serve the other's weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHTS_FILE = "model.safetensors"


def model_family(model_dir: Path) -> str | None:
    """A digest of everything in `model_dir` but its weights (config, tokenizer, chat template), or None when
    its weights are not one `model.safetensors` file (the one layout a gateway is pushed weights from)."""
    if not (model_dir / WEIGHTS_FILE).is_file():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        if path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".partial"):
            continue
        digest.update(str(path.relative_to(model_dir)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


class GatewayPool:
    """Idle gateway children by key; at most `max_idle` in all, the longest parked stopped first."""

    def __init__(self, max_idle: int = 2) -> None:
        self.max_idle = max_idle
        self._idle: list[tuple[Hashable, GatewayProcess]] = []
        self._lock = threading.Lock()

    def take(self, key: Hashable) -> GatewayProcess | None:
        """A parked child for `key` that is still alive, removed from the pool; None if there is none."""
        dead: list[GatewayProcess] = []
        found = None
        with self._lock:
            for i, (k, child) in enumerate(self._idle):
                if k != key:
                    continue
                if not child.alive():
                    dead.append(child)
                    continue
                found = child
                del self._idle[i]
                break
            self._idle = [(k, c) for k, c in self._idle if all(c is not d for d in dead)]
        for child in dead:
            child.stop()
        return found

    def park(self, key: Hashable, child: GatewayProcess) -> None:
        """Keep `child` for the next `take(key)`; a dead child is stopped (its files removed) instead."""
        if not child.alive():
            child.stop()
            return
        with self._lock:
            self._idle.append((key, child))
            evicted = self._idle[: max(0, len(self._idle) - self.max_idle)]
            self._idle = self._idle[len(evicted) :]
        for _, old in evicted:
            old.stop()

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def clear(self) -> None:
        """Stop every parked child: all signalled at once, then each waited for."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, child in idle:
            child.terminate()
        for _, child in idle:
            child.stop()


POOL = GatewayPool()
atexit.register(POOL.clear)
