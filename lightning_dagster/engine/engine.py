"""The policy engine: any Hugging Face causal LM directory, chat rendering, and a thin batched sampling loop
over the model's forward that returns the exact logprob of every sampled token."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_dagster.engine.chat import normalize_messages
from lightning_dagster.engine.chat import parse_assistant as _parse_assistant
from lightning_dagster.engine.prefix_cache import PrefixCache, RowKV


class EngineError(ValueError):
    """A request the engine cannot serve (bad sampling parameters, bad or too long prompt)."""


class NonFiniteLogits(RuntimeError):
    """The model itself is broken (a server-side fault, not the request's)."""


class StateDictMismatch(ValueError):
    """`load_weights` got a state dict that does not fit the model; nothing was changed."""


@dataclass
class SamplingParams:
    """temperature 0 means greedy; its reported logprobs are then under T=1 (the model's own distribution),
    since a point mass would report 0 for every token."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.temperature, int | float) or not self.temperature >= 0:
            raise EngineError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise EngineError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise EngineError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise EngineError("stop must be a list of non-empty strings")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise EngineError(f"seed must be an integer or None, got {self.seed!r}")


@dataclass
class Generation:
    """`token_ids` include the final EOS token when the model ended its turn (it was sampled and has a
    logprob); `text` excludes special tokens and is cut before a matched stop string, as OpenAI does, while
    `token_ids` keep every sampled token up to the one that completed the stop string."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: Literal["stop", "length"]


class Engine:
    """Loads any HF causal LM directory in float32 (a bf16 checkpoint would otherwise stay bf16 and its
    logprobs drift by ~5e-2). `generate` and `load_weights` are serialised by one lock.

    `threads` sets torch's intra-op threads for the process (torch has one global setting); None means
    `$LD_ENGINE_THREADS` or 1. One thread is the default because on a shared 2-core machine two OpenMP
    threads spin against other processes: sampling measured 7-50x slower than with one (see
    benchmarks/README.md). Batching, not threads, is what makes this tiny model fast.

    `prefix_cache_mb` bounds the keys/values kept from finished rows (0 turns it off): a prompt that
    extends an earlier prompt+response exactly, as a multi-turn conversation does through the gateway's
    token-in, prefills only its new tokens. `load_weights` empties it.
    """

    def __init__(
        self, model_dir: Path | str, *, threads: int | None = None, prefix_cache_mb: int = 256
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads or int(os.environ.get("LD_ENGINE_THREADS", "1")))
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.eval()
        self.eos_token_ids: set[int] = _eos_ids(self.model, self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id: int = pad if pad is not None else min(self.eos_token_ids, default=0)
        self.vocab_size: int = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_length: int = int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)
        self._lock = threading.Lock()
        self._seed_source = random.SystemRandom()
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb and _plain_kv_layers(self.model) else None
        )

    # -- text <-> tokens ------------------------------------------------------------------------------
    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """OpenAI-shaped messages (and tools) -> prompt ids via the checkpoint's chat template."""
        text = self.tokenizer.apply_chat_template(
            normalize_messages(messages),
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return self.encode(text)

    def encode(self, text: str) -> list[int]:
        """Text -> ids with no BOS/EOS added (chat templates write their own special tokens)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Ids -> text without special tokens (tool-call markers are not special and stay)."""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def parse_assistant(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        return _parse_assistant(text)

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights into the live model. All or nothing: names and shapes are checked before any
        tensor is copied (tied weights may be given once, as safetensors files store them). Waits for the
        running `generate` to finish, so no request sees half-updated weights."""
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
        with self._lock, torch.no_grad():
            for target, source in sources:
                target.copy_(source)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()  # keys and values computed by the old weights

    # -- sampling -------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Generation]:
        """Sample a continuation of every prompt in one left-padded batch.

        The logprob of each sampled token is `log_softmax(logits / T)` in float32, renormalised over the
        top-p set when top_p < 1 (greedy: under T=1). A seeded request draws from its own torch.Generator,
        one uniform per step, so its tokens do not depend on its batch mates.
        """
        plist = self.validate(prompts, params)
        if not prompts:
            return []
        with self._lock, torch.inference_mode():
            return self._generate(prompts, plist)

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

    def _generate(self, prompts: list[list[int]], plist: list[SamplingParams]) -> list[Generation]:
        from transformers import DynamicCache

        n = len(prompts)
        cache = DynamicCache(config=self.model.config)
        # Identical prompts (a GRPO group sent at once) are prefilled once, then their rows are copied.
        first: dict[tuple[int, ...], int] = {}
        inverse = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts])
        unique = [list(key) for key in first]
        unique_hits = [self.prefix_cache.lookup(p) if self.prefix_cache is not None else None for p in unique]
        hits = [unique_hits[j] for j in inverse.tolist()]
        mask, ids = self._prefill_inputs(unique, unique_hits, cache)
        limits = [min(p.max_tokens, self.max_length - len(q)) for p, q in zip(plist, prompts, strict=True)]
        gens = [torch.Generator().manual_seed(self._seed(p)) for p in plist]
        temps = torch.tensor([p.temperature for p in plist], dtype=torch.float32)
        top_ps = torch.tensor([p.top_p for p in plist], dtype=torch.float32)
        rows = [_Row(p, self) for p in plist]

        active = list(range(n))  # original indices of the rows still in the batch
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        logits = self._forward(ids, mask, positions, cache)
        if len(unique) < n:
            cache.batch_select_indices(inverse)
            mask, logits = mask[inverse], logits[inverse]
        while True:
            tokens, logprobs = _sample(logits, temps, top_ps, [gens[i] for i in active])
            still: list[int] = []
            for k, i in enumerate(active):
                if rows[i].push(int(tokens[k]), float(logprobs[k]), limits[i]):
                    still.append(k)
                elif self.prefix_cache is not None:
                    # the cache holds this row's prompt and every sampled token but the last (never fed)
                    kv = [
                        (layer.keys[k][:, mask[k].bool()], layer.values[k][:, mask[k].bool()])
                        for layer in cache.layers
                    ]
                    hit = hits[i]
                    self.prefix_cache.store(
                        prompts[i] + rows[i].token_ids[:-1], kv, replaces=hit[0] if hit else None
                    )
            if not still:
                break
            if len(still) < len(active):
                # Drop finished rows from the batch (and their cache) instead of padding them along.
                keep = torch.tensor(still)
                cache.batch_select_indices(keep)
                mask, tokens = mask[keep], tokens[keep]
                temps, top_ps = temps[keep], top_ps[keep]
                active = [active[k] for k in still]
            mask = torch.cat([mask, torch.ones((len(active), 1), dtype=torch.long)], dim=1)
            positions = mask.sum(-1, keepdim=True) - 1
            logits = self._forward(tokens[:, None], mask, positions, cache)
        return [row.result(prompt) for row, prompt in zip(rows, prompts, strict=True)]

    def _prefill_inputs(
        self, prompts: list[list[int]], hits: list[tuple[tuple[int, ...], RowKV] | None], cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-pad the cached prefixes into `cache` and the rest of each prompt into one block after them:
        [pad | cached prefix | pad | new prompt tokens]. Padding in the middle is fine: the attention mask
        hides it and positions come from the mask's cumulative sum. Returns (full mask, block ids)."""
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
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :].float()
        if not bool(torch.isfinite(logits).all()):  # e.g. diverged weights pushed by the trainer
            raise NonFiniteLogits(f"the model at {self.model_dir} produced NaN or infinite logits")
        return logits

    def _seed(self, p: SamplingParams) -> int:
        # any int is a valid request seed; torch takes [0, 2**64)
        return p.seed % (1 << 64) if p.seed is not None else self._seed_source.getrandbits(63)


class _Row:
    """One request's growing output and its stop rules."""

    def __init__(self, params: SamplingParams, engine: Engine) -> None:
        self.params = params
        self.engine = engine
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: Literal["stop", "length"] = "length"
        self.stop_at: int | None = None  # text offset of the matched stop string
        self._eos = False
        self._tail_tokens = 4 * max((len(s) for s in params.stop), default=0) + 8

    def push(self, token: int, logprob: float, limit: int) -> bool:
        """Append a sampled token; False once the row is finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.engine.eos_token_ids:
            self.finish_reason, self._eos = "stop", True
            return False
        if self.params.stop and self._find_stop():
            self.finish_reason = "stop"
            return False
        return len(self.token_ids) < limit

    def _find_stop(self) -> bool:
        # Decode only the tail: a stop string completed by the newest token lies within the last 4L+8 tokens
        # (L characters are at most 4L UTF-8 bytes, each non-special token is at least one byte; the slack
        # covers a character cut at the tail's start). The full text is decoded once, on a hit.
        tail = self.engine.decode(self.token_ids[-self._tail_tokens :])
        if not any(s in tail for s in self.params.stop):
            return False
        text = self.engine.decode(self.token_ids)
        hits = [j for j in (text.find(s) for s in self.params.stop) if j >= 0]
        if hits:
            self.stop_at = min(hits)
        return bool(hits)

    def result(self, prompt: list[int]) -> Generation:
        text = self.engine.decode(self.token_ids[:-1] if self._eos else self.token_ids)
        if self.stop_at is not None:
            text = text[: self.stop_at]
        return Generation(list(prompt), self.token_ids, self.logprobs, text, self.finish_reason)


def _sample(
    logits: torch.Tensor, temps: torch.Tensor, top_ps: torch.Tensor, gens: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by inverse-CDF sampling with one uniform from the row's own generator.

    Returns the tokens and their logprobs under the distribution actually sampled from.
    """
    greedy = temps == 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    if bool((top_ps < 1).any()):
        logp = _top_p(logp, top_ps)
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
    cdf = logp.double().exp().cumsum(-1)
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    tokens = tokens.clamp(max=logits.shape[-1] - 1)
    # float rounding can land u at the very top of the CDF, on a token outside the kept set
    bad = torch.isinf(logp.gather(1, tokens[:, None]).squeeze(1))
    tokens = torch.where(greedy | bad, logp.argmax(-1), tokens)
    if bool(greedy.any()):
        logp = torch.where(greedy[:, None], torch.log_softmax(logits, dim=-1), logp)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _top_p(logp: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches top_p; renormalise over it."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    mass_before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
    drop_sorted = mass_before >= top_ps[:, None]
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), dim=-1)


def _plain_kv_layers(model: Any) -> bool:
    """Prefix reuse splices per-row keys/values; only plain full-attention layers store them that way."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
