"""Runs inside the vLLM venv, which lacks lightning_dagster (standard library, torch and safetensors only):
the launcher that ties a vLLM server's life to its owner, and the worker extension that loads weights by hash.

Launcher: `python ld_vllm_worker.py WATCH_FD -- ARGV...` runs ARGV in its own process group and ends the
whole group once WATCH_FD reaches end of file (the owner closed it or died, SIGKILL included) or the server
exits. A pipe, not PR_SET_PDEATHSIG, which fires when the *thread* that started the child ends.

Worker extension (`--worker-extension-cls ld_vllm_worker.WeightsByHash`, called through `POST
/collective_rpc`): on CPU, vLLM repacks linear weights and empties `layer.weight`, so served parameters cannot
be hashed back; `ld_load_weights` hashes exactly the tensors it hands to the model instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

GRACE_S = 10.0  # how long the server may take to stop after SIGTERM before its group is killed
PR_SET_PDEATHSIG = 1


def tensors_digest_update(digest: Any, name: str, tensor: Any) -> None:
    """One tensor's share of the checkpoint hash (`engine.build.tensors_hash`): name, dtype, shape, bytes."""
    import torch

    t = tensor.contiguous()
    digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
    digest.update(t.view(torch.uint8).numpy().tobytes())


class WeightsByHash:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; names start with `ld_` so none collides
    with the worker's own (vLLM refuses a collision)."""

    ld_served: dict[str, Any] | None = None

    def ld_load_weights(self, weights_path: str, expected_hash: str) -> dict[str, Any]:
        """Load every tensor of `weights_path`'s *.safetensors files into the served model, in name order,
        hashing each; verified only if the hash is `expected_hash`, every parameter was loaded and every
        layer computes with its loaded weight (else recorded as unverified, with the reason)."""
        from safetensors import safe_open

        self.ld_served = _state(weights_path, None, "a load is under way or failed")
        files = sorted(Path(weights_path).glob("*.safetensors"))
        if not files:
            self.ld_served = _state(weights_path, None, f"no *.safetensors files in {weights_path}")
            return self.ld_served
        handles = [safe_open(str(f), framework="pt") for f in files]
        where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118
        digest = hashlib.sha256()

        def weights():
            for name in sorted(where):
                tensor = where[name].get_tensor(name)
                tensors_digest_update(digest, name, tensor)
                yield name, tensor

        model = self.model_runner.get_model()
        lora = self.model_runner.lora_config is not None
        wanted = {n.replace(".base_layer.", ".") if lora else n for n, _ in model.named_parameters()}
        loaded: set[str] = set()
        load = model.load_weights

        def load_and_record(weights_iter):  # vLLM only logs the parameters a load missed: record them
            result = load(weights_iter)
            loaded.update(result or ())
            return result

        model.load_weights = load_and_record
        try:
            self.model_runner.reload_weights(weights_iterator=weights(), is_checkpoint_format=True)
        finally:
            del model.load_weights
        actual = digest.hexdigest()
        missing = sorted(wanted - loaded)
        stale = refresh_kernels(model)
        if actual != expected_hash:
            error = f"the loaded tensors hash to {actual}, not {expected_hash}"
        elif missing:
            error = f"{len(missing)} parameters were not loaded: {missing[:5]}"
        elif stale:
            error = f"layers still compute with other weights than their own: {stale[:5]}"
        else:
            error = None
        self.ld_served = _state(weights_path, None if error else actual, error)
        return self.ld_served

    def ld_served_weights(self) -> dict[str, Any]:
        """What the last `ld_load_weights` recorded (hash None: not verified, with the reason)."""
        return self.ld_served or _state(None, None, "no weights were loaded by hash yet")


def _state(path: str | None, verified_hash: str | None, error: str | None) -> dict[str, Any]:
    return {"hash": verified_hash, "path": path, "error": error}


# layer methods whose function is F.linear(x, weight, bias): a quantized layer's weight is not its matrix
UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def refresh_kernels(model: Any) -> list[str]:
    """Layers whose kernel computes with something other than their weight parameter, after one attempt to
    rebuild each such kernel. vLLM's CPU backend packs weights into kernel-private copies and an in-place
    reload repacks only layers that received tensors: an LM head tied to the embedding receives none and
    would keep the previous embedding. Only layers that keep their weight can be checked."""
    import torch

    generator = torch.Generator().manual_seed(0)
    stale = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        if (
            type(method).__name__ not in UNQUANTIZED
            or not isinstance(weight, torch.Tensor)
            or not weight.numel()
        ):
            continue
        probe = torch.randn(2, weight.shape[1], generator=generator).to(weight.device, weight.dtype)
        bias = getattr(module, "bias", None)
        want = torch.nn.functional.linear(probe, weight, bias)
        if _agrees(method.apply(module, probe, bias), want):
            continue
        method.process_weights_after_loading(module)
        if not _agrees(method.apply(module, probe, bias), want):
            stale.append(name)
    return stale


def _agrees(got: Any, want: Any) -> bool:
    # kernels reorder sums (float32: ~1e-6 relative); another checkpoint's weights differ by O(1)
    return bool((got.float() - want.float()).norm() <= 1e-3 * want.float().norm() + 1e-6)


def _die_with_launcher() -> None:
    """In the server, before exec: SIGTERM (a clean stop) if the launcher dies without stopping it. Safe
    here, though a parent-death signal follows the starting thread: the launcher's one thread starts it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def main(argv: list[str]) -> None:
    watch_fd, separator, *command = argv
    if separator != "--" or not command:
        sys.exit("usage: ld_vllm_worker.py WATCH_FD -- ARGV...")
    # the server stays in this process's group (the owner starts it in a session of its own): one killpg
    # ends the server, its engine processes and this launcher, and a signal to the owner's group reaches none
    server = subprocess.Popen(command, preexec_fn=_die_with_launcher)

    def stop() -> None:  # twice (end of file and SIGTERM) is harmless
        server.terminate()
        try:
            server.wait(GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(0, signal.SIGKILL)

    def watch() -> None:
        with os.fdopen(int(watch_fd), "rb") as pipe:
            while pipe.read(4096):
                pass
        stop()

    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=stop, daemon=True).start())
    threading.Thread(target=watch, daemon=True).start()
    status = server.wait()
    print(f"[ld_vllm_worker] the vLLM server exited with status {status}", flush=True)
    os.killpg(0, signal.SIGKILL)  # the engine processes it left behind, and this launcher with them


if __name__ == "__main__":
    main(sys.argv[1:])
