"""The one way to stand up a gateway on this machine, in this process or in a child process."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dagster.gateway.keys import GatewayKeys
from lightning_dagster.gateway.options import GatewayOptions

if TYPE_CHECKING:
    import torch

    from lightning_dagster.store import Store


class WeightsNotServed(RuntimeError):
    """`load_weights` on a gateway that forwards to an upstream server: the upstream serves fixed weights."""


class LocalGateway:
    """A live gateway for `store` serving `model_dir` as `options` say, on `url` (`keys` None: fresh ones,
    dying with this gateway).

    `child=True`: all of it in a child process (`GatewayProcess`), so harness workers and the decode loop do
    not share one interpreter lock; it needs a store another process can open (a SQLite file or PostgreSQL).
    With `options.serving.upstream_url` every call goes upstream; `model_dir` is then optional (the served
    model's tokenizer, for token-in) and `load_weights` raises `WeightsNotServed`. `reuse` (child, embedded
    engine, fresh keys): take and leave a child in `gateway.pool`, so a pipeline's stages start one child.
    """

    def __init__(
        self,
        store: Store,
        model_dir: Path | str | None,
        options: GatewayOptions | None = None,
        *,
        keys: GatewayKeys | None = None,
        resource_id: str | None = None,
        child: bool = False,
        reuse: bool = False,
    ) -> None:
        self.options = options or GatewayOptions()
        self.upstream_url = self.options.serving.upstream_url or None
        if model_dir is None and not self.upstream_url:
            raise ValueError("a local gateway needs a model directory or an upstream URL")
        self.keys = keys or GatewayKeys.fresh()
        self.resource_id = resource_id
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._process: Any = None
        self._pool_key: Any = None  # set when the child goes back to the pool on close
        self._server: Any = None
        self._batching: Any = None
        self._backend: Any = None
        self.codec: Any = None
        if child:
            self._start_process(store, reuse=reuse and keys is None)
        else:
            self._start_thread(store)

    @property
    def secret(self) -> str:
        return self.keys.secret

    def _start_process(self, store: Store, *, reuse: bool) -> None:
        from lightning_dagster.engine.chat import ChatCodec
        from lightning_dagster.gateway.pool import POOL, WEIGHTS_FILE, model_family
        from lightning_dagster.gateway.process import GatewayProcess

        url = store.engine.url
        if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
            raise ValueError("a gateway child needs a store another process can open, not in-memory SQLite")
        family = model_family(self.model_dir) if reuse and self.model_dir and not self.upstream_url else None
        if family is not None:
            self._pool_key = (store.url, family, self.options.model_dump_json())
            child = POOL.take(self._pool_key)
            if child is not None:
                try:
                    child.load_weights_file(self.model_dir / WEIGHTS_FILE, self.resource_id)
                    self._process, self.keys = child, child.keys
                except Exception:  # noqa: BLE001 - it died since it was parked, or refused: start afresh
                    child.stop()
        if self._process is None:
            self._process = GatewayProcess(
                store.url, self.model_dir, self.options, self.keys, resource_id=self.resource_id
            )
        self.codec = ChatCodec(self.model_dir) if self.model_dir is not None else None

    def _start_thread(self, store: Store) -> None:
        # Imported here: torch and the web stack cost seconds, and a parent of a gateway child needs neither.
        from lightning_dagster.gateway.app import create_app
        from lightning_dagster.gateway.backends import EngineBackend
        from lightning_dagster.gateway.server import GatewayServer

        serving = self.options.serving
        if self.upstream_url or serving.engine == "vllm":
            from lightning_dagster.engine.chat import ChatCodec

            self.codec = ChatCodec(self.model_dir) if self.model_dir is not None else None
        if self.upstream_url:
            from lightning_dagster.gateway.upstreams import UpstreamBackend

            # with the served model's codec, prompts reach the upstream as exact token ids (token-in)
            upstream_model = self.options.upstream_model or None
            self._backend = UpstreamBackend(
                self.upstream_url, self.keys.upstream_api_key, upstream_model, codec=self.codec
            )
            self._backend.resource_id = self.resource_id
        elif serving.engine == "vllm":
            from lightning_dagster.gateway.vllm_backend import VllmBackend, start_vllm

            server = start_vllm(self.model_dir, self.options)
            lora = self.options.lora
            self._backend = VllmBackend(server, self.codec, lora=lora, resource_id=self.resource_id)
        else:
            engine = {"threads": serving.engine_threads, "device": serving.engine_device}
            if serving.engine_process:
                from lightning_dagster.engine.remote import EngineProcess

                self._batching = EngineProcess(self.model_dir, max_batch=serving.max_batch, **engine)
            else:
                from lightning_dagster.engine import BatchingEngine, Engine

                self._batching = BatchingEngine(Engine(self.model_dir, **engine), max_batch=serving.max_batch)
            self._backend = EngineBackend(self._batching, self.resource_id)
            self.codec = self._batching.engine
        app = create_app(store, self._backend, keys=self.keys, options=self.options)
        self._server = GatewayServer(app, host=serving.host, port=serving.port)
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
        """The process that serves: the child, or this one."""
        return self._process.pid if self._process is not None else os.getpid()

    def stats(self) -> dict:
        """What `/admin/stats` reports: a child's, else the engine's counters (none for an upstream)."""
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
            from lightning_dagster.gateway.weightsync import load_into

            gate = self._server.app.state.gateway.weights  # calls in flight finish first
            gate.swap_from_thread(lambda: load_into(self._backend, dict(state_dict), resource_id))
        self.resource_id = resource_id

    def verify(self) -> None:
        """Raise unless the engine still serves the weights last loaded and verified."""
        if self._process is not None:
            self._process.verify()
        elif self._backend is not None:
            self._backend.verify(self._server.app.state.gateway.weights.current.weights_hash)

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
