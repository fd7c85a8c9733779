"""`RunningBatch`: the rows sampled together, prefilled into the KV cache and stepped token by token."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import torch

from lightning_dagster.engine.kv import left_pad, new_cache
from lightning_dagster.engine.prefix_cache import RowKV
from lightning_dagster.engine.sampling import EngineError, Generation, SamplingParams, sample

if TYPE_CHECKING:
    from lightning_dagster.engine.engine import Engine


class NonFiniteLogits(RuntimeError):
    """The model itself is broken (a server-side fault, not the request's)."""


Outcome = tuple[Any, "Generation | Exception"]  # (the caller's tag, its result or its failure)


class RunningBatch:
    """The rows being sampled together, with their KV cache and next-token logits; callers hold
    `engine.exclusive()`. Padding sits under mask 0 anywhere (positions are the mask's cumulative sum).

    A finished row's slot goes dead (mask 0) rather than being cut out: cutting rows out copies the whole
    cache (a sizeable share of a decode step, benchmarks/README.md, continuous batching), while a new row
    can be written into a dead slot in place. Dead slots are compacted once over a quarter of the batch.
    A failure inside `step` fails only the rows it affects (non-finite logits: those; a failed forward: all).
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.slots: list[_Row | None] = []  # None: a dead slot, still in the cache tensors
        self._live = 0
        self._cache: Any = None
        self._mask = torch.zeros((0, 0), dtype=torch.long)
        self._logits = torch.zeros((0, engine.vocab_size))
        self._temps = torch.zeros(0)
        self._top_ps = torch.zeros(0, dtype=torch.float64)  # the requested top_p, not its float32 neighbour

    def __len__(self) -> int:
        return self._live

    def can_admit(self) -> bool:
        """A model whose cache layers are not plain (e.g. sliding windows) only starts fresh batches."""
        return not self._live or self.engine.mergeable

    def admit(self, prompts: list[list[int]], plist: list[SamplingParams], tags: list[Any]) -> list[Outcome]:
        """Prefill validated requests into the batch, all or nothing; returns the rows failed at once."""
        if not self.can_admit():
            raise RuntimeError("this model's cache cannot take rows into a running batch")
        engine, n = self.engine, len(prompts)
        with torch.inference_mode():
            cache = new_cache(engine.model, engine.mergeable)
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
                sampled, logprobs = sample(
                    self._logits if full else self._logits[index],
                    self._temps if full else self._temps[index],
                    self._top_ps if full else self._top_ps[index],
                    [self.slots[k].gen for k in live],  # type: ignore[union-attr]
                )
                tokens = sampled
                if not full:  # dead slots are fed padding
                    tokens = torch.full((len(self.slots),), self.engine.pad_token_id, dtype=torch.long)
                    tokens[index] = sampled
                for j, k in enumerate(live):
                    row = self.slots[k]
                    assert row is not None
                    logprob = float(logprobs[j])
                    if not math.isfinite(logprob):
                        # finite logits divided by a vanishing temperature overflow float32: the request's
                        # fault, and a NaN logprob recorded for training would poison the trainer's step
                        outcomes.append((row.tag, _overflow(row.params)))
                        self._kill(k)
                        continue
                    if row.push(int(sampled[j]), logprob):
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
        """Put prefilled rows into dead slots when they fit, else append them; returns their slot indices."""
        temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
        top_ps = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64)
        n = len(rows)
        self._live += n
        if not self.slots:
            self._cache, self._mask, self._logits = cache, mask, logits
            self._temps, self._top_ps = temps, top_ps
            self.slots = list(rows)
            return list(range(n))
        width, new_width = self._mask.shape[1], mask.shape[1]
        free = [k for k, row in enumerate(self.slots) if row is None][:n]
        if len(free) == n and new_width <= width:
            index = torch.tensor(free)
            # the dead rows' old keys stay left of the new ones, under mask 0
            self._mask[index] = left_pad(mask, width, -1)
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
        self._mask = torch.cat([left_pad(self._mask, width, -1), left_pad(mask, width, -1)])
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([left_pad(old.keys, width, -2), left_pad(new.keys, width, -2)])
            old.values = torch.cat([left_pad(old.values, width, -2), left_pad(new.values, width, -2)])
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
        """Cut leading columns no slot attends to (a view, so free: the next forward copies the cache)."""
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


def _overflow(params: SamplingParams) -> EngineError:
    return EngineError(
        f"sampling at temperature {params.temperature!r} gave a NaN or infinite logprob (the logits divided "
        "by it overflow float32); use temperature 0 for greedy decoding"
    )


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
