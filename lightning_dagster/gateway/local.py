"""The one way to stand up a gateway on this machine: the embedded engine (or an upstream server) behind the
gateway app, in this process or in a child process, for the runner CLI, the RL loop, the rollback probe and
`lightning-dagster gateway serve`.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

    from lightning_dagster.gateway.agl import AglSettings
    from lightning_dagster.store import Store

Serving = Literal["thread", "process"]


class WeightsNotServed(RuntimeError):
    """`load_weights` on a gateway that forwards to an upstream server: the upstream serves fixed weights."""


class LocalGateway:
    """A live gateway for `store`, on `url`, signing attempt keys with `secret`.

    `serving="thread"`: engine, batching loop and HTTP server in this process. `serving="process"`: all of
    it in a child process (`GatewayProcess`), so harness workers and the decode loop do not share one
    interpreter lock; it needs a store another process can open (a SQLite file or PostgreSQL).
    `upstream_url`: every call goes to that OpenAI-compatible server (or those, comma-separated: sticky
    per rollout, with failover) instead of the embedded engine; `model_dir` is then optional (the served
    model's tokenizer: it provides `codec`, and prompts go upstream as exact token ids), and
    `load_weights` raises `WeightsNotServed`.
    `model_aliases`: the model names served besides the model's own (what the harness sends).
    `agl`: also serve Agent Lightning v1.0's server surface with these settings (thread mode).
    `engine_process` (embedded engine): the model and its batching loop in a process of their own
    (`engine.remote.EngineProcess`), so the decode loop does not share an interpreter lock with the HTTP
    server, rendering and span writes; in process mode, in a grandchild of this process.
    `model_roots`: the directories `POST /admin/weights` may read (default: the models directory; a process
    child also reads the folder its parent writes pushed weights to).
    `port=0` picks a free port; `secret=None` generates a fresh one (keys then die with this gateway).
    `codec` renders, decodes and parses the checkpoint's chats: the engine itself in thread mode, a
    `ChatCodec` otherwise (None without `model_dir`).
    `reuse` (process mode, embedded engine): take a child another `reuse` gateway of this process left with
    the same settings and a model of the same family, with `model_dir`'s weights pushed into it, and leave
    the child for the next one on `close` (`gateway.pool`): a pipeline's stages start one child, not one
    each.
    """

    def __init__(
        self,
        store: Store,
        model_dir: Path | str | None,
        *,
        serving: Serving = "thread",
        upstream_url: str | None = None,
        upstream_model: str | None = None,
        upstream_api_key: str = "",
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
        admin_key: str | None = None,
        max_batch: int = 64,
        threads: int | None = None,
        device: str = "auto",
        engine_process: bool = False,
        resource_id: str | None = None,
        serve_keys: Sequence[str] = (),
        max_body_bytes: int = 4 << 20,
        write_behind_ms: float = 0.0,
        fsync_spans: bool = False,
        model_roots: Sequence[Path | str] | None = None,
        model_aliases: Sequence[str] = ("policy",),
        agl: AglSettings | None = None,
        reuse: bool = False,
    ) -> None:
        if serving not in ("thread", "process"):
            raise ValueError(f"serving must be 'thread' or 'process', got {serving!r}")
        if model_dir is None and not upstream_url:
            raise ValueError("a local gateway needs a model directory or an upstream URL")
        self.serving = serving
        self.upstream_url = upstream_url or None
        self.secret = secret or secrets.token_hex(32)  # hex: never starts with "-" (read as a CLI flag)
        self.resource_id = resource_id
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._process: Any = None
        self._pool_key: Any = None  # set when the child goes back to the pool on close
        self._server: Any = None
        self._batching: Any = None
        self._backend: Any = None
        self.codec: Any = None
        options = {
            "max_body_bytes": max_body_bytes,
            "write_behind_ms": write_behind_ms,
            "fsync_spans": fsync_spans,
            "model_aliases": tuple(model_aliases),
        }
        if model_roots is not None:
            options["model_roots"] = [Path(r) for r in model_roots]
        if agl is not None:
            if serving == "process":
                raise ValueError("the Agent Lightning surface (agl=...) is served in thread mode only")
            options["agl"] = agl
        common = {
            "host": host, "port": port, "max_batch": max_batch, "threads": threads, "device": device,
            "engine_process": engine_process, "serve_keys": serve_keys,
            "upstream_model": upstream_model, "upstream_api_key": upstream_api_key, "app_options": options,
        }  # fmt: skip
        if serving == "process":
            self._start_process(store, reuse=reuse and secret is None, **common)
        else:
            self._start_thread(store, admin_key=admin_key or secrets.token_hex(32), **common)

    def _start_process(self, store: Store, *, reuse: bool, app_options: Mapping[str, Any], **kw: Any) -> None:
        from lightning_dagster.engine.chat import ChatCodec
        from lightning_dagster.gateway.pool import POOL, WEIGHTS_FILE, model_family
        from lightning_dagster.gateway.process import GatewayProcess

        url = store.engine.url
        if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
            raise ValueError("serving='process' needs a store another process can open, not in-memory SQLite")
        family = model_family(self.model_dir) if reuse and self.model_dir and not self.upstream_url else None
        if family is not None:
            self._pool_key = (store.url, family, repr(sorted(kw.items())), repr(sorted(app_options.items())))
            child = POOL.take(self._pool_key)
            if child is not None:
                try:
                    child.load_weights_file(self.model_dir / WEIGHTS_FILE, self.resource_id)
                    self._process, self.secret = child, child.secret
                except Exception:  # noqa: BLE001 - it died since it was parked, or refused: start afresh
                    child.stop()
        if self._process is None:
            self._process = GatewayProcess(
                store.url,
                self.model_dir,
                upstream_url=self.upstream_url,
                secret=self.secret,
                resource_id=self.resource_id,
                **kw,
                **app_options,
            )
        self.codec = ChatCodec(self.model_dir) if self.model_dir is not None else None

    def _start_thread(
        self,
        store: Store,
        *,
        host: str,
        port: int,
        admin_key: str,
        max_batch: int,
        threads: int | None,
        device: str,
        engine_process: bool,
        serve_keys: Sequence[str],
        upstream_model: str | None,
        upstream_api_key: str,
        app_options: Mapping[str, Any],
    ) -> None:
        # Imported here: torch and the web stack cost seconds, and a process-mode parent needs neither.
        from lightning_dagster.gateway.app import create_app
        from lightning_dagster.gateway.backends import EngineBackend
        from lightning_dagster.gateway.server import GatewayServer

        if self.upstream_url:
            from lightning_dagster.gateway.upstreams import UpstreamBackend

            if self.model_dir is not None:
                from lightning_dagster.engine.chat import ChatCodec

                self.codec = ChatCodec(self.model_dir)
            # with the served model's codec, prompts reach the upstream as exact token ids (token-in)
            self._backend = UpstreamBackend(
                self.upstream_url, upstream_api_key, upstream_model, codec=self.codec
            )
            self._backend.resource_id = self.resource_id
        else:
            if engine_process:
                from lightning_dagster.engine.remote import EngineProcess

                self._batching = EngineProcess(
                    self.model_dir, max_batch=max_batch, threads=threads, device=device
                )
            else:
                from lightning_dagster.engine import BatchingEngine, Engine

                self._batching = BatchingEngine(
                    Engine(self.model_dir, threads=threads, device=device), max_batch=max_batch
                )
            self._backend = EngineBackend(self._batching, self.resource_id)
            self.codec = self._batching.engine
        app = create_app(
            store,
            self._backend,
            secret=self.secret,
            admin_key=admin_key,
            serve_keys=serve_keys,
            **app_options,
        )
        self._server = GatewayServer(app, host=host, port=port)
        try:
            self._server.start()
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return self._process.url if self._process is not None else self._server.url

    @property
    def pid(self) -> int:
        """The process that serves: the child in process mode, this one in thread mode."""
        return self._process.pid if self._process is not None else os.getpid()

    @property
    def backend_kind(self) -> str:
        return "upstream" if self.upstream_url else "engine"

    def stats(self) -> dict:
        """What `/admin/stats` reports: in process mode the child's (token-in and engine counters), in thread
        mode the engine's counters (`engine`, absent for an upstream)."""
        if self._process is not None:
            return self._process.stats()
        return {"engine": self._batching.counters()} if self._batching is not None else {}

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], resource_id: str | None = None) -> None:
        """Serve `state_dict` from the next call on; spans record `resource_id`."""
        if self.upstream_url:
            raise WeightsNotServed(
                f"this gateway forwards to {self.upstream_url}, which serves fixed weights; push them there"
            )
        if self._process is not None:
            self._process.load_weights(state_dict, resource_id)
        else:
            from lightning_dagster.gateway.weightsync import ServedWeights, weights_hash

            def load() -> ServedWeights:
                self.codec.load_weights(state_dict)
                self._backend.resource_id = resource_id
                return ServedWeights(None, resource_id, weights_hash(state_dict))

            self._server.app.state.gateway.weights.swap_from_thread(load)  # calls in flight finish first
        self.resource_id = resource_id

    def close(self) -> None:
        if self._process is not None:
            if self._pool_key is not None:
                from lightning_dagster.gateway.pool import POOL

                POOL.park(self._pool_key, self._process)
            else:
                self._process.stop()
            self._process = None
        if self._server is not None:
            self._server.stop()
        if self._batching is not None:
            self._batching.close()

    def __enter__(self) -> LocalGateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
