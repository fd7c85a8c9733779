"""Packed little-endian int32 token ids and float32 logprobs: engines compute them in float32, so they
round-trip exactly (another float64 comes back rounded, relative error below 6e-8)."""

from __future__ import annotations

import functools
import struct
import sys
from array import array
from collections.abc import Sequence

from lightning_dagster.store.errors import InvalidInput

_SWAP = sys.byteorder != "little"  # the stored format is little-endian on every machine
assert array("i").itemsize == 4 and array("f").itemsize == 4


def _pack(typecode: str, values: list) -> bytes:
    # struct packs a list faster than array() does; array unpacks faster than struct.
    try:
        return struct.pack(f"<{len(values)}{typecode}", *values)
    except (struct.error, OverflowError, TypeError) as exc:
        kind = "int32 token ids" if typecode == "i" else "float32 logprobs"
        raise InvalidInput(f"cannot pack {kind}: {exc}") from exc


def _unpack(typecode: str, data: bytes) -> list:
    arr = array(typecode)
    arr.frombytes(data)
    if _SWAP:
        arr.byteswap()
    return arr.tolist()


pack_ids = functools.partial(_pack, "i")
unpack_ids = functools.partial(_unpack, "i")
pack_logprobs = functools.partial(_pack, "f")
unpack_logprobs = functools.partial(_unpack, "f")


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading items two sequences (id lists, packed bytes) share: a binary search of slices."""
    n = min(len(a), len(b))
    if (a if len(a) == n else a[:n]) == (b if len(b) == n else b[:n]):
        return n  # the common case: a prompt that extends the previous call exactly (one copy, not two)
    lo, hi = 0, n  # invariant: the first lo items match, the first hi items do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
