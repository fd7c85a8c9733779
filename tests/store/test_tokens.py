"""The pure token helpers: little-endian packing and the shared-prefix search."""

from __future__ import annotations

import random
import struct

import pytest

from lightning_dagster.store import InvalidInput
from lightning_dagster.store.tokens import pack_ids, pack_logprobs, shared_prefix, unpack_ids, unpack_logprobs


def test_packing_is_little_endian_int32_and_float32():
    assert pack_ids([1, -2, 2**31 - 1]) == struct.pack("<3i", 1, -2, 2**31 - 1)
    assert unpack_ids(pack_ids([1, -2, 2**31 - 1])) == [1, -2, 2**31 - 1]
    assert pack_logprobs([-0.5, float("-inf")]) == struct.pack("<2f", -0.5, float("-inf"))
    assert unpack_logprobs(pack_logprobs([-0.5, float("-inf")])) == [-0.5, float("-inf")]
    assert pack_ids([]) == b"" and unpack_ids(b"") == []
    for bad in ([2**31], [-(2**31) - 1]):
        with pytest.raises(InvalidInput):
            pack_ids(bad)
    with pytest.raises(InvalidInput):
        pack_logprobs([1e300])


def test_shared_prefix_matches_a_plain_scan():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 5))]
        expected = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        assert shared_prefix(a, b) == shared_prefix(b, a) == expected
