"""The policy engine: any Hugging Face causal LM directory, chat rendering, and a thin batched sampling loop
over the model's forward that returns the exact logprob of every sampled token. The loop itself is
`batch.RunningBatch`, its cache `kv`, its sampling step `sampling`."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from lightning_dagster.engine.batch import RunningBatch
from lightning_dagster.engine.chat import ChatCodec, eos_ids
from lightning_dagster.engine.kv import plain_kv_layers
from lightning_dagster.engine.prefix_cache import PrefixCache, RowKV
from lightning_dagster.engine.sampling import EngineError, Generation, SamplingParams
from lightning_dagster.settings import UsageError


class StateDictMismatch(ValueError):
    """`load_weights` got a state dict that does not fit the model; nothing was changed."""


class DeviceUnavailable(RuntimeError, UsageError):
    """A device was asked for that this machine's torch cannot use (not a device name, or no such GPU)."""


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`: CUDA when present, else CPU; any other value is a torch device name (`cpu`, `cuda`, `cuda:1`)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise DeviceUnavailable(
            f"{device!r} is not a torch device (auto, cpu, cuda, cuda:N): {exc}"
        ) from None
    if resolved.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (resolved.index or 0) >= count:
            raise DeviceUnavailable(
                f"device {device!r} asked for, but torch {torch.__version__} sees {count} CUDA device(s)"
            )
    return resolved


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; CPU runs in float32, exactly as the trainer scores."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Engine(ChatCodec):
    """A checkpoint's text side (`ChatCodec`) and its model, loaded in float32 (the trainer scores in
    float32: a bf16 model would not reproduce its logprobs). `generate`, `load_weights` and a
    `BatchingEngine`'s running batch are serialised by one lock (`exclusive()`). `threads` defaults to one:
    on a shared 2-core machine two OpenMP threads spin against other processes and sampling slows down many
    times over (benchmarks/README.md, engine). `prefix_cache_mb` 0 turns the prefix cache off.
    """

    def __init__(
        self, model_dir: Path | str, *, threads: int = 1, prefix_cache_mb: int = 256, device: str = "auto"
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.padding_side = "left"
        self.device = resolve_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(self.device)
        self.model.eval()
        sources = [getattr(self.model, "generation_config", None), self.model.config]
        super().__init__(model_dir, tokenizer, eos_ids(sources, tokenizer))  # the text side
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else min(self.eos_token_ids, default=0)
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_length: int = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self._lock = threading.Lock()
        self._waiting_lock = threading.Lock()
        self.waiting = 0  # threads blocked in exclusive(); a continuous batch stops admitting while > 0
        self._seed_source = random.SystemRandom()
        # rows can be spliced in and out of the KV cache only when every layer stores plain per-row keys and
        # values: prefix reuse and admitting rows into a running batch both need it
        self.mergeable: bool = plain_kv_layers(self.model)
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb and self.mergeable else None
        )

    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights into the live model, all or nothing (tied weights may be given once). Waits for
        the running rows to drain, so every token of a request comes from one set of weights."""
        current = self.model.state_dict()
        unknown = sorted(set(state_dict) - set(current))
        shapes = [
            k for k, v in state_dict.items() if k in current and tuple(v.shape) != tuple(current[k].shape)
        ]
        # a tied group (e.g. lm_head.weight and embed_tokens.weight) is one storage: any one name loads it
        groups: dict[int, list[str]] = {}
        for name, tensor in current.items():
            groups.setdefault(tensor.data_ptr(), []).append(name)
        missing = sorted(names[0] for names in groups.values() if not any(n in state_dict for n in names))
        if unknown or shapes or missing:
            raise StateDictMismatch(
                f"unknown: {unknown[:5]}, wrong shape: {shapes[:5]}, missing: {missing[:5]}"
            )
        sources = []
        for names in groups.values():
            given = [state_dict[n] for n in names if n in state_dict]
            if any(not torch.equal(given[0], other) for other in given[1:]):
                raise StateDictMismatch(f"tied weights {names} were given different values")
            sources.append((current[names[0]], given[0]))
        with self.exclusive(), torch.no_grad():
            for target, source in sources:
                target.copy_(source)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # keys and values computed by the old weights

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Generation]:
        """Sample a continuation of every prompt in one batch. Each token's logprob is `log_softmax(logits /
        T)` in float32, renormalised over the top-p set (greedy: under T=1); a seeded request draws from its
        own torch.Generator, so its tokens do not depend on its batch mates."""
        plist = self.validate(prompts, params)
        if not prompts:
            return []
        results: list[Generation | None] = [None] * len(prompts)
        with self.exclusive():
            batch = RunningBatch(self)
            outcomes = batch.admit(prompts, plist, list(range(len(prompts))))
            while True:
                for i, outcome in outcomes:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    results[i] = outcome
                if not batch:
                    break
                outcomes = batch.step()
        assert all(r is not None for r in results)  # every row ends with a result or an exception
        return results  # type: ignore[return-value]

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the engine lock, counted in `waiting` while blocked (a continuous batch then drains)."""
        with self._waiting_lock:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._waiting_lock:
                self.waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    def validate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[SamplingParams]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        for prompt, p in zip(prompts, plist, strict=True):
            if not isinstance(p, SamplingParams):
                raise EngineError("params must be SamplingParams")
            p.validate()
            if not prompt or not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt):
                raise EngineError(f"a prompt must be a non-empty list of token ids in [0, {self.vocab_size})")
            if len(prompt) >= self.max_length:
                raise EngineError(f"prompt of {len(prompt)} tokens exceeds the context of {self.max_length}")
        return plist

    def _prefill_inputs(
        self, prompts: list[list[int]], hits: list[tuple[tuple[int, ...], RowKV] | None], cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad the cached prefixes into `cache` and the rest of each prompt into one block after them:
        [pad | cached prefix | pad | new prompt tokens] (the mask hides padding anywhere). Returns (full
        mask, block ids)."""
        n = len(prompts)
        cached = [len(h[0]) if h else 0 for h in hits]
        width_p = max(cached)
        rest = [p[c:] for p, c in zip(prompts, cached, strict=True)]
        width_s = max(len(r) for r in rest)
        ids = torch.full((n, width_s), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((n, width_p + width_s), dtype=torch.long)
        for i, r in enumerate(rest):
            ids[i, width_s - len(r) :] = torch.tensor(r)
            mask[i, width_p - cached[i] : width_p] = 1
            mask[i, width_p + width_s - len(r) :] = 1
        if width_p:
            for layer_idx, (k0, v0) in enumerate(next(h[1] for h in hits if h)):
                keys = k0.new_zeros((n, k0.shape[0], width_p, k0.shape[2]))
                values = v0.new_zeros((n, v0.shape[0], width_p, v0.shape[2]))
                for i, h in enumerate(hits):
                    if h:
                        keys[i, :, width_p - cached[i] :] = h[1][layer_idx][0]
                        values[i, :, width_p - cached[i] :] = h[1][layer_idx][1]
                cache.update(keys, values, layer_idx)
        return mask, ids

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        with autocast(self.device):
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        # sampling runs on CPU generators; RunningBatch checks each row for NaN/inf
        return out.logits[:, -1, :].float().cpu()

    def _seed(self, p: SamplingParams) -> int:
        # any int is a valid request seed; torch takes [0, 2**64)
        return p.seed % (1 << 64) if p.seed is not None else self._seed_source.getrandbits(63)
