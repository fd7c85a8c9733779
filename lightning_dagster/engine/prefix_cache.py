"""Keys and values of finished rows, kept so that a next turn which extends `prompt + response` exactly (what
the gateway's token-in sends) prefills only its new tokens. Must be cleared whenever the weights change."""

from __future__ import annotations

from collections import OrderedDict

import torch

# one (keys, values) pair per layer, each [heads, tokens, head_dim]
RowKV = list[tuple[torch.Tensor, torch.Tensor]]


class PrefixCache:
    """LRU over whole token sequences, bounded in bytes. `lookup` finds the longest stored sequence that is a
    strict prefix of a prompt (at least one prompt token must still be run to get the next logits)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # prompt tokens served from the cache, for benchmarks and tests
        self._entries: OrderedDict[tuple[int, ...], tuple[RowKV, int]] = OrderedDict()
        self._lengths: dict[int, int] = {}  # sequence length -> entries of that length

    def lookup(self, prompt: list[int]) -> tuple[tuple[int, ...], RowKV] | None:
        for length in sorted(self._lengths, reverse=True):
            if length < len(prompt):
                key = tuple(prompt[:length])
                found = self._entries.get(key)
                if found is not None:
                    self._entries.move_to_end(key)
                    self.hits += length
                    return key, found[0]
        return None

    def store(self, tokens: list[int], kv: RowKV, *, replaces: tuple[int, ...] | None = None) -> None:
        """Keep `kv` for `tokens`; `replaces` is the entry this row started from, now superseded by a longer
        copy of the same conversation."""
        if replaces is not None:
            self._drop(replaces)
        size = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)
        if size > self.max_bytes:
            return
        key = tuple(tokens)
        self._drop(key)
        self._entries[key] = (kv, size)
        self._lengths[len(key)] = self._lengths.get(len(key), 0) + 1
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._lengths.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, key: tuple[int, ...]) -> None:
        found = self._entries.pop(key, None)
        if found is None:
            return
        self.bytes -= found[1]
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
