"""The prefix cache's bookkeeping: longest strict prefix wins, byte budget evicts least recently used."""

from __future__ import annotations

import torch

from lightning_dagster.engine.prefix_cache import PrefixCache


def _kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(2, tokens, 4), torch.zeros(2, tokens, 4))]  # 64 bytes per token


def test_lookup_takes_the_longest_strict_prefix():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.store([1, 2], _kv(2))
    cache.store([1, 2, 3, 4], _kv(4))
    cache.store([9, 9, 9], _kv(3))
    assert cache.lookup([1, 2, 3, 4, 5])[0] == (1, 2, 3, 4)
    assert cache.lookup([1, 2, 3])[0] == (1, 2)
    assert cache.lookup([1, 2, 3, 4])[0] == (1, 2)  # equal length is not a strict prefix
    assert cache.lookup([1]) is None and cache.lookup([5, 6, 7]) is None
    assert cache.hits == 4 + 2 + 2


def test_byte_budget_evicts_least_recently_used_and_replaces_drops_the_old_turn():
    cache = PrefixCache(max_bytes=64 * 10)
    cache.store([1, 2, 3, 4], _kv(4))
    cache.store([5, 6, 7, 8], _kv(4))
    cache.lookup([1, 2, 3, 4, 0])  # touch: now [5..8] is the least recently used
    cache.store([9, 9, 9], _kv(3))
    assert cache.lookup([5, 6, 7, 8, 0]) is None and cache.lookup([1, 2, 3, 4, 0]) is not None
    assert cache.bytes == 64 * 7 and len(cache) == 2
    cache.store([1, 2, 3, 4, 0, 1], _kv(6), replaces=(1, 2, 3, 4))
    assert cache.lookup([1, 2, 3, 4, 0]) is None  # the old turn was replaced by its continuation
    assert len(cache) == 2 and cache.bytes == 64 * 9
    cache.store([7, 7], _kv(2))  # 11 tokens > 10: the least recently used, [9, 9, 9], goes
    assert cache.lookup([9, 9, 9, 0]) is None and cache.lookup([1, 2, 3, 4, 0, 1, 2]) is not None
    cache.store(list(range(20)), _kv(20))  # larger than the whole budget: not kept, nothing evicted
    assert len(cache) == 2 and cache.bytes == 64 * 8
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0 and cache.lookup([1, 2, 3, 4, 0, 1, 2]) is None
