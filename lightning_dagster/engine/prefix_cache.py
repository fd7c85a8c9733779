"""Keys and values of finished rows, kept so that a next turn which extends `prompt + response` exactly (what
the gateway's token-in sends) prefills only its new tokens. Must be cleared whenever the weights change."""

from __future__ import annotations

from collections import Counter

import torch
from cachetools import LRUCache

# one (keys, values) pair per layer, each [heads, tokens, head_dim]
RowKV = list[tuple[torch.Tensor, torch.Tensor]]


def _nbytes(kv: RowKV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


class _Entries(LRUCache):
    """An LRU bounded in bytes that also counts its keys by length, however they leave (eviction included)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(maxsize=max_bytes, getsizeof=_nbytes)
        self.lengths: Counter[int] = Counter()

    def __setitem__(self, key: tuple[int, ...], value: RowKV) -> None:
        fresh = key not in self
        super().__setitem__(key, value)
        if fresh:
            self.lengths[len(key)] += 1

    def __delitem__(self, key: tuple[int, ...]) -> None:
        super().__delitem__(key)
        self.lengths[len(key)] -= 1
        if not self.lengths[len(key)]:
            del self.lengths[len(key)]

    def clear(self) -> None:
        super().clear()
        self.lengths.clear()


class PrefixCache:
    """LRU over whole token sequences, bounded in bytes. `lookup` finds the longest stored sequence that is a
    strict prefix of a prompt (at least one prompt token must still be run to get the next logits)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.hits = 0  # prompt tokens served from the cache, for benchmarks and tests
        self._entries = _Entries(max_bytes)

    @property
    def bytes(self) -> int:
        return int(self._entries.currsize)

    def lookup(self, prompt: list[int]) -> tuple[tuple[int, ...], RowKV] | None:
        for length in sorted(self._entries.lengths, reverse=True):
            if length < len(prompt):
                key = tuple(prompt[:length])
                found = self._entries.get(key)  # a hit becomes the most recently used
                if found is not None:
                    self.hits += length
                    return key, found
        return None

    def store(self, tokens: list[int], kv: RowKV, *, replaces: tuple[int, ...] | None = None) -> None:
        """Keep `kv` for `tokens`; `replaces` is the entry this row started from, now superseded."""
        if replaces is not None:
            self._entries.pop(replaces, None)
        if _nbytes(kv) > self.max_bytes:
            return
        key = tuple(tokens)
        self._entries.pop(key, None)
        self._entries[key] = kv  # evicts the least recently used entries until it fits

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
