"""The running batch's KV cache on top of transformers' `DynamicCache`: growing layers that write each decode
step in place, left padding, and the check that a model's layers are plain enough to splice rows."""

from __future__ import annotations

import functools
from typing import Any

import torch

GROW_ROOM = 64  # spare key/value columns a growing layer allocates, i.e. decode steps between copies


def new_cache(model: Any, growing: bool) -> Any:
    """A DynamicCache for `model`, with growing layers if `growing` (its layers must be plain)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if growing:
        cache.layers = [_growing_layer_type()() for _ in cache.layers]
    return cache


@functools.cache
def _growing_layer_type() -> type:
    """A plain DynamicLayer that writes each step's keys and values into preallocated room: `torch.cat`
    copied the whole cache every decode step, the largest single cost of a large batch's step
    (benchmarks/README.md, continuous batching). Built lazily, as transformers is imported lazily."""
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
                shape = (*key_states.shape[:2], used + n + GROW_ROOM, key_states.shape[-1])
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


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zeros before `t` along `dim` (-1 for a mask, -2 for keys/values) up to `width`."""
    missing = width - t.shape[dim]
    if not missing:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def plain_kv_layers(model: Any) -> bool:
    """Prefix reuse splices per-row keys/values; only plain full-attention layers store them that way."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layers = DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
