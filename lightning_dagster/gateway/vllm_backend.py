"""`engine: vllm`: the policy served by a vLLM server the gateway owns (or one the user runs), token-in, with
the trainer's weights synced into it and verified by hash before any call samples from them.

Calls go through `UpstreamBackend`. A weight push writes a checkpoint folder for vLLM to reload (with LoRA,
an adapter folder hot-loaded under its own model name) and returns once the server reports serving exactly
those tensors; one that does not verify raises, and the weights verified before keep serving.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.upstreams import UpstreamBackend

if TYPE_CHECKING:
    import torch

    from lightning_dagster.engine.vllm_server import VllmServer
    from lightning_dagster.gateway.options import GatewayOptions, LoraSpec

SERVED_NAME = "policy"  # the base model's name on the vLLM server (the harness's names map to it)


def start_vllm(model_dir: Path, options: GatewayOptions) -> VllmServer:
    """The server for `model_dir`: started from the vLLM venv with the serving settings' flags, or the
    user's own at `vllm_url`; verified to serve `model_dir`'s weights."""
    from lightning_dagster.engine.build import checkpoint_hash
    from lightning_dagster.engine.vllm_server import VllmServer

    serving = options.serving
    rank = options.lora.rank if options.lora is not None else None
    if serving.vllm_url:
        server = VllmServer.attach(serving.vllm_url, model_dir, name=SERVED_NAME, max_lora_rank=rank)
        server.expected_hash = server.reload_weights(model_dir, checkpoint_hash(model_dir))
        return server
    return VllmServer(
        model_dir,
        name=SERVED_NAME,
        dtype=serving.vllm_dtype,
        enforce_eager=serving.vllm_enforce_eager,
        max_lora_rank=rank,
        extra_args=tuple(serving.vllm_args),
    ).start()


class VllmBackend(UpstreamBackend):
    """The policy on `server` (token-in through `codec`, the served model's chat codec). With `lora`, pushed
    weights with LoRA names are that adapter's, served under the adapter's own name."""

    kind = "vllm"
    loads_weights = True

    def __init__(
        self, server: VllmServer, codec, *, lora: LoraSpec | None = None, resource_id: str | None = None
    ):
        super().__init__(server.base_url, model=SERVED_NAME, codec=codec)
        self.server = server
        self.model_dir = server.model_dir
        self.resource_id = resource_id
        self._adapter_hash: str | None = None  # the adapter served, if one is
        self.lora = lora
        self._pushes = 0
        self._verified = (server.model_dir, server.expected_hash or "")  # the whole weights last verified

    def serves(self, name: str) -> bool:
        return True  # the gateway's model names decide; every call goes to what was last verified

    def load_weights(self, state: dict[str, torch.Tensor], resource_id: str | None) -> None:
        """Blocking. Weights with LoRA names are an adapter, others the whole model's. A push that does not
        verify raises GatewayError 502, after putting back the weights verified before."""
        from lightning_dagster.engine.build import save_weights, tensors_hash
        from lightning_dagster.engine.vllm_server import VllmError, adapter_hash

        self._pushes += 1
        folder = self.server.work_dir / f"push-{self._pushes}"
        folder.mkdir(parents=True)
        adapter = any(".lora_A." in name or ".lora_B." in name for name in state)
        try:
            if adapter:
                if self.lora is None:
                    raise GatewayError(409, "LoRA weights pushed to a vLLM server started without LoRA")
                save_weights(state, folder / "adapter_model.safetensors")
                config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "r": self.lora.rank,
                          "lora_alpha": self.lora.alpha, "target_modules": list(self.lora.targets)}  # fmt: skip
                (folder / "adapter_config.json").write_text(json.dumps(config))
                name, digest = resource_id or f"adapter-{self._pushes}", adapter_hash(folder)
                self.server.load_adapter(name, folder, digest)  # refused before loading, or not served
                self._model, self._adapter_hash = name, digest
                shutil.rmtree(folder, ignore_errors=True)  # the server serves its own snapshot of it
            else:
                save_weights(state, folder / "model.safetensors")
                digest = tensors_hash(state)
                try:
                    self.server.reload_weights(folder, digest)
                except VllmError:
                    self.server.reload_weights(self._verified[0], self._verified[1])  # put back
                    raise
                if self._verified[0] != self.model_dir:
                    shutil.rmtree(self._verified[0], ignore_errors=True)
                self._verified = (folder, digest)
                self._model, self._adapter_hash = SERVED_NAME, None
        except VllmError as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise GatewayError(502, f"vLLM did not take the weights of {resource_id}: {exc}") from exc
        self.resource_id = resource_id

    def verify(self, weights: str | None) -> None:
        """GatewayError 409 unless the server still serves what the last push verified (whole weights:
        their hash `weights`; an adapter: its snapshot)."""
        from lightning_dagster.engine.vllm_server import VllmError

        try:
            if self._adapter_hash is not None:
                self.server.verify_adapter(self._model, self._adapter_hash)
            elif weights is not None:
                self.server.verify_weights(weights)
        except VllmError as exc:
            raise GatewayError(409, f"vLLM no longer serves the verified weights: {exc}") from exc

    async def aclose(self) -> None:
        await super().aclose()
        self.server.stop()
