"""The policy engine: any Hugging Face causal LM directory, chat rendering, and a thin batched sampling loop
over the model's forward that returns the exact logprob of every sampled token.

The loop is `RunningBatch`: rows are admitted (prefilled, then merged into the running KV cache) and stepped
one token at a time. `Engine.generate` admits its prompts once and steps until all are done; `BatchingEngine`
admits new requests between steps (continuous batching)."""

from __future__ import annotations

import functools
import os
import random
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_dagster.engine.chat import ChatCodec, eos_ids
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


class Engine(ChatCodec):
    """A checkpoint's text side (`ChatCodec`: render, encode, decode, parse_assistant) and its model.
    Loads any HF causal LM directory in float32 (a bf16 checkpoint would otherwise stay bf16 and its
    logprobs drift by ~5e-2). `generate`, `load_weights` and a `BatchingEngine`'s running batch are
    serialised by one lock (`exclusive()`).

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
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
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
        self.mergeable: bool = _plain_kv_layers(self.model)
        self.prefix_cache: PrefixCache | None = (
            PrefixCache(prefix_cache_mb << 20) if prefix_cache_mb and self.mergeable else None
        )

    # -- weights --------------------------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy new weights into the live model. All or nothing: names and shapes are checked before any
        tensor is copied (tied weights may be given once, as safetensors files store them). Waits for the
        running `generate` (or a `BatchingEngine`'s running rows, which stop admitting and drain) to finish,
        so every token of a request comes from one set of weights."""
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

    # -- sampling -------------------------------------------------------------------------------------
    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Generation]:
        """Sample a continuation of every prompt in one left-padded batch.

        The logprob of each sampled token is `log_softmax(logits / T)` in float32, renormalised over the
        top-p set when top_p < 1 (greedy: under T=1). A seeded request draws from its own torch.Generator,
        one uniform per step, so its tokens do not depend on its batch mates (nor, through a BatchingEngine,
        on when it joined the running batch). The prompts are admitted into one `RunningBatch` at once and
        stepped until every row is done.
        """
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
        """Hold the engine lock, counted in `waiting` while blocked on it. A continuous batch (which holds
        the lock while it has rows) stops admitting while someone waits, drains, and lets them in."""
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
        return out.logits[:, -1, :].float()  # RunningBatch checks each row for NaN/inf

    def _seed(self, p: SamplingParams) -> int:
        # any int is a valid request seed; torch takes [0, 2**64)
        return p.seed % (1 << 64) if p.seed is not None else self._seed_source.getrandbits(63)


Outcome = tuple[Any, "Generation | Exception"]  # (the caller's tag, its result or its failure)


class RunningBatch:
    """The rows being sampled together, with their KV cache and next-token logits.

    `admit` prefills new requests (identical prompts once, cached prefixes reused) and places them in the
    running cache, left-padded with zero keys under mask 0: positions come from the mask's cumulative sum, so
    padding anywhere is exact. `step` samples one token for every row, returns the rows that finished, and
    feeds the rest their token (one forward). `Engine.generate` admits once and steps to the end;
    `BatchingEngine` admits between steps. Callers hold `engine.exclusive()` across calls.

    The cache is a set of slots. A finished row's slot goes dead (mask 0) rather than being cut out at once:
    cutting rows out, like appending them, copies the whole cache (as costly as a third of a decode step at 64
    rows), while a new row can be written into a dead slot in place. Dead slots are compacted away once they
    are over a quarter of the batch.

    Each outcome is `(tag, Generation)` or `(tag, exception)`; a failure inside `step` fails only the rows
    it affects (non-finite logits: those rows; a failed forward: every remaining row), never earlier results.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.slots: list[_Row | None] = []  # None: a dead slot, still in the cache tensors
        self.steps = 0  # decode steps taken (each samples one token for every row)
        self._live = 0
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)
        self._logits = torch.zeros((0, engine.vocab_size))
        self._temps = torch.zeros(0)
        self._top_ps = torch.zeros(0)

    def __len__(self) -> int:
        return self._live

    def can_admit(self) -> bool:
        """A model whose cache layers are not plain (e.g. sliding windows) only starts fresh batches."""
        return not self._live or self.engine.mergeable

    def admit(self, prompts: list[list[int]], plist: list[SamplingParams], tags: list[Any]) -> list[Outcome]:
        """Prefill validated requests and add them to the batch. All or nothing: if the prefill raises, the
        batch is unchanged. Returns the rows failed at once (non-finite logits)."""
        if not self.can_admit():
            raise RuntimeError("this model's cache cannot take rows into a running batch")
        engine, n = self.engine, len(prompts)
        with torch.inference_mode():
            cache = _new_cache(engine)
            # Identical prompts (a GRPO group sent at once) are prefilled once, then their rows are copied.
            first: dict[tuple[int, ...], int] = {}
            inverse = torch.tensor([first.setdefault(tuple(p), len(first)) for p in prompts])
            unique = [list(key) for key in first]
            pc = engine.prefix_cache
            unique_hits = [pc.lookup(p) if pc is not None else None for p in unique]
            mask, ids = engine._prefill_inputs(unique, unique_hits, cache)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
            logits = engine._forward(ids, mask, positions, cache)
            if len(unique) < n:
                cache.batch_select_indices(inverse)
                mask, logits = mask[inverse], logits[inverse]
            rows = [
                _Row(q, p, engine, tag, unique_hits[j])
                for q, p, tag, j in zip(prompts, plist, tags, inverse.tolist(), strict=True)
            ]
            placed = self._place(cache, mask, logits, rows)
            return self._fail_nonfinite(placed)

    def step(self) -> list[Outcome]:
        """Sample one token for every row; return the rows that finished with it."""
        outcomes: list[Outcome] = []
        try:
            with torch.inference_mode():
                live = [k for k, row in enumerate(self.slots) if row is not None]
                index = torch.tensor(live)
                full = len(live) == len(self.slots)
                sampled, logprobs = _sample(
                    self._logits if full else self._logits[index],
                    self._temps if full else self._temps[index],
                    self._top_ps if full else self._top_ps[index],
                    [self.slots[k].gen for k in live],  # type: ignore[union-attr]
                )
                self.steps += 1
                tokens = sampled
                if not full:  # dead slots are fed padding
                    tokens = torch.full((len(self.slots),), self.engine.pad_token_id, dtype=torch.long)
                    tokens[index] = sampled
                for j, k in enumerate(live):
                    row = self.slots[k]
                    assert row is not None
                    if row.push(int(sampled[j]), float(logprobs[j])):
                        continue
                    self._store_prefix(k, row)
                    outcomes.append((row.tag, row.result()))
                    self._kill(k)
                if not self._live:
                    self.abandon()
                    return outcomes
                if 4 * (len(self.slots) - self._live) > len(self.slots):
                    keep = [k for k, row in enumerate(self.slots) if row is not None]
                    tokens = tokens[keep]
                    self._select(keep)
                self._trim()
                self._mask = torch.cat([self._mask, torch.ones((len(self.slots), 1), dtype=torch.long)], 1)
                positions = self._mask.sum(-1, keepdim=True) - 1
                self._logits = self.engine._forward(tokens[:, None], self._mask, positions, self._cache)
                outcomes += self._fail_nonfinite([k for k, row in enumerate(self.slots) if row is not None])
        except Exception as exc:  # noqa: BLE001 - the batch state is unknown: fail the rows still running
            outcomes += [(tag, exc) for tag in self.abandon()]
        return outcomes

    def abandon(self) -> list[Any]:
        """Drop every row (their results are lost); returns the tags of those not finished."""
        tags = [row.tag for row in self.slots if row is not None and not row.done]
        self.slots, self._live, self._cache = [], 0, None
        return tags

    def _place(self, cache: Any, mask: torch.Tensor, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Put prefilled rows into dead slots in place when they fit, else append them (compacting first).
        Returns their slot indices."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        top_ps = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
        n = len(rows)
        self._live += n
        if not self.slots:
            self._cache, self._mask, self._logits, self._temps, self._top_ps = (
                cache,
                mask,
                logits,
                temps,
                top_ps,
            )
            self.slots = list(rows)
            return list(range(n))
        width, new_width = self._mask.shape[1], mask.shape[1]
        free = [k for k, row in enumerate(self.slots) if row is None][:n]
        if len(free) == n and new_width <= width:
            index = torch.tensor(free)
            # the dead rows' old keys stay left of the new ones, under mask 0
            self._mask[index] = _left_pad(mask, width, -1)
            for old, new in zip(self._cache.layers, cache.layers, strict=True):
                old.keys[index, :, width - new_width :] = new.keys
                old.values[index, :, width - new_width :] = new.values
            self._logits[index], self._temps[index], self._top_ps[index] = logits, temps, top_ps
            for k, row in zip(free, rows, strict=True):
                self.slots[k] = row
            return free
        if self._live - n < len(self.slots):
            self._select([k for k, row in enumerate(self.slots) if row is not None])
        width = max(self._mask.shape[1], new_width)
        self._mask = torch.cat([_left_pad(self._mask, width, -1), _left_pad(mask, width, -1)])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, -2), _left_pad(new.keys, width, -2)])
            old.values = torch.cat([_left_pad(old.values, width, -2), _left_pad(new.values, width, -2)])
        self._logits = torch.cat([self._logits, logits])
        self._temps, self._top_ps = torch.cat([self._temps, temps]), torch.cat([self._top_ps, top_ps])
        self.slots = self.slots + rows
        return list(range(len(self.slots) - n, len(self.slots)))

    def _kill(self, k: int) -> None:
        """The row in slot k is done: its slot stays in the tensors, attending to nothing but its padding."""
        row = self.slots[k]
        assert row is not None
        row.done = True
        self.slots[k] = None
        self._live -= 1
        self._mask[k] = 0

    def _select(self, keep: list[int]) -> None:
        """Keep only these slots (a copy of the whole cache)."""
        index = torch.tensor(keep)
        self._cache.batch_select_indices(index)
        self._mask, self._logits = self._mask[index], self._logits[index]
        self._temps, self._top_ps = self._temps[index], self._top_ps[index]
        self.slots = [self.slots[k] for k in keep]

    def _trim(self) -> None:
        """Cut leading columns no slot attends to (left by a long row that finished): a view, so free here;
        the next forward's concatenation copies the cache anyway."""
        lead = int(self._mask.any(0).int().argmax())
        if lead:
            self._mask = self._mask[:, lead:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, lead:], layer.values[:, :, lead:]

    def _fail_nonfinite(self, slots: list[int]) -> list[Outcome]:
        """Fail the rows among `slots` whose next-token logits are NaN or infinite (e.g. diverged weights)."""
        if not slots:
            return []
        finite = torch.isfinite(self._logits[torch.tensor(slots)]).all(-1).tolist()
        if all(finite):
            return []
        error = NonFiniteLogits(f"the model at {self.engine.model_dir} produced NaN or infinite logits")
        failed: list[Outcome] = []
        for k, ok in zip(slots, finite, strict=True):
            row = self.slots[k]
            if not ok and row is not None:
                failed.append((row.tag, error))
                self._kill(k)
        if not self._live:
            self.abandon()
        return failed

    def _store_prefix(self, k: int, row: _Row) -> None:
        if self.engine.prefix_cache is None:
            return
        # the cache holds this row's prompt and every sampled token but the last (never fed)
        used = self._mask[k].bool()
        kv = [(layer.keys[k][:, used], layer.values[k][:, used]) for layer in self._cache.layers]
        self.engine.prefix_cache.store(
            row.prompt + row.token_ids[:-1], kv, replaces=row.hit[0] if row.hit else None
        )


_GROW_ROOM = 64  # spare key/value columns a growing layer allocates, i.e. decode steps between copies


def _new_cache(engine: Engine) -> Any:
    """A DynamicCache for the engine's model, with growing layers where its layers are plain."""
    from transformers import DynamicCache

    cache = DynamicCache(config=engine.model.config)
    if engine.mergeable:
        cache.layers = [_growing_layer_type()() for _ in cache.layers]
    return cache


@functools.cache
def _growing_layer_type() -> type:
    """A plain DynamicLayer that writes each step's keys and values into preallocated room instead of
    concatenating: `torch.cat` copied the whole cache every decode step, the largest single cost of a step
    at 48 rows (~30%). Built lazily, as transformers is imported lazily."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        _view: torch.Tensor | None = None  # `keys` as last returned; anything else means it was replaced
        _room_k: torch.Tensor
        _room_v: torch.Tensor

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            used = self.keys.shape[-2] if self.keys.numel() else 0
            # keys replaced from outside (row selection, trimming, merging) or out of room: copy once into a
            # new buffer; writes into the current view (a row put in a dead slot) keep the buffer
            if not (
                self.keys is self._view
                and used + n <= self._room_k.shape[-2]
                and self._room_k.shape[0] == key_states.shape[0]
            ):
                shape = (*key_states.shape[:2], used + n + _GROW_ROOM, key_states.shape[-1])
                self._room_k, self._room_v = key_states.new_empty(shape), value_states.new_empty(shape)
                if used:
                    self._room_k[:, :, :used] = self.keys
                    self._room_v[:, :, :used] = self.values
            self._room_k[:, :, used : used + n] = key_states
            self._room_v[:, :, used : used + n] = value_states
            self.keys = self._view = self._room_k[:, :, : used + n]
            self.values = self._room_v[:, :, : used + n]
            return self.keys, self.values

    return GrowingLayer


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zeros before `t` along `dim` (-1 for a mask, -2 for keys/values) up to `width`."""
    missing = width - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class _Row:
    """One request's growing output and its stop rules."""

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        engine: Engine,
        tag: Any,
        hit: tuple[tuple[int, ...], RowKV] | None,
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.engine = engine
        self.tag = tag
        self.hit = hit  # the prefix-cache entry this row started from, superseded when the row finishes
        self.limit = min(params.max_tokens, engine.max_length - len(prompt))
        self.gen = torch.Generator().manual_seed(engine._seed(params))
        self.done = False
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: Literal["stop", "length"] = "length"
        self.stop_at: int | None = None  # text offset of the matched stop string
        self._eos = False
        self._tail_tokens = 4 * max((len(s) for s in params.stop), default=0) + 8

    def push(self, token: int, logprob: float) -> bool:
        """Append a sampled token; False once the row is finished."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if token in self.engine.eos_token_ids:
            self.finish_reason, self._eos = "stop", True
            return False
        if self.params.stop and self._find_stop():
            self.finish_reason = "stop"
            return False
        return len(self.token_ids) < self.limit

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

    def result(self) -> Generation:
        text = self.engine.decode(self.token_ids[:-1] if self._eos else self.token_ids)
        if self.stop_at is not None:
            text = text[: self.stop_at]
        return Generation(list(self.prompt), self.token_ids, self.logprobs, text, self.finish_reason)


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
