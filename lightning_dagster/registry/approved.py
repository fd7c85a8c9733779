"""What serving loads: `approved-default` while its history verifies and MLflow's alias agrees; and the probe
that proves a checkpoint serves (a temporary gateway over a scratch store, so its span never lands among
the serve rollouts the sensor counts), shared by rollback and the drill.
"""

from __future__ import annotations

import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster.registry import pointers
from lightning_dagster.registry.errors import AliasDiverged

if TYPE_CHECKING:
    from lightning_dagster.registry.core import Registry
    from lightning_dagster.settings import ServingSettings


def approved_for_serving(reg: Registry, *, download: bool = True) -> pointers.ResolvedVersion:
    """`approved-default` with its checkpoint; `AliasDiverged` while MLflow's alias names another version."""
    reg.connect()
    pointer = reg.verified().require().value
    mv = reg.alias_version(pointers.APPROVED)
    alias = None if mv is None else str(mv.version)
    if alias != pointer:
        raise AliasDiverged(reg.model_name, pointers.APPROVED, alias, pointer)
    return pointers.resolve(reg, pointers.APPROVED, download=download)


def serve_once(
    checkpoint_dir: Path,
    *,
    on_loaded: Callable[[], None] | None = None,
    timeout: float = 60.0,
    serving: ServingSettings | None = None,
) -> str:
    """Serve `checkpoint_dir` on 127.0.0.1 and return one chat completion's text; `on_loaded` is called once
    the weights are served ("did not load" vs "did not answer")."""
    import openai

    from lightning_dagster.gateway.keys import GatewayKeys
    from lightning_dagster.gateway.local import LocalGateway
    from lightning_dagster.gateway.options import gateway_options
    from lightning_dagster.settings import ServingSettings
    from lightning_dagster.store import Store

    key = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="ld-serve-probe-") as tmp:
        scratch = Store(f"sqlite:///{Path(tmp) / 'probe.db'}")
        try:
            # one call: the embedded engine in this process, no second process to start for it
            options = gateway_options(
                ServingSettings(max_batch=1, engine_process=False)
                if serving is None or serving.engine == "embedded"
                else serving.updated({"upstream_url": "", "host": "127.0.0.1", "port": 0, "secret": ""})
            )
            keys = GatewayKeys.fresh(serve_keys=(key,))
            with LocalGateway(scratch, checkpoint_dir, options, keys=keys) as gateway:
                if on_loaded is not None:
                    on_loaded()
                client = openai.OpenAI(
                    base_url=f"{gateway.url}/v1", api_key=key, timeout=timeout, max_retries=0
                )
                reply = client.chat.completions.create(
                    model=Path(checkpoint_dir).name,
                    messages=[{"role": "user", "content": "What is 2 + 3?"}],
                    max_tokens=8,
                    temperature=0.0,
                    seed=0,
                )
        finally:
            scratch.engine.dispose()
    if not reply.choices:
        raise RuntimeError("the gateway answered with no choices")
    return reply.choices[0].message.content or ""
