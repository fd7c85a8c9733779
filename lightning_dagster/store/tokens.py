"""Compact token arrays: packed little-endian int32 ids, float32 logprobs, and shared-prefix lengths.

float32 is enough for logprobs: engines compute them in float32, so they round-trip bit for bit; any other
float64 comes back rounded to the nearest float32 (relative error below 6e-8, far under sampling noise).
"""

from __future__ import annotations

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


def pack_ids(ids: list[int]) -> bytes:
    return _pack("i", ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpack("i", data)


def pack_logprobs(values: list[float]) -> bytes:
    return _pack("f", values)


def unpack_logprobs(data: bytes) -> list[float]:
    return _unpack("f", data)


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading items two sequences (id lists, or packed bytes) share (binary search over
    C-speed slice compares)."""
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
