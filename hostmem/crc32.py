"""CRC-32 (zlib's) of a large buffer, as fast as this host takes it.

:func:`crc32` is ISA-L's where the ``isal`` package is installed (carry-less
multiplication, over 20 GiB/s on one core) and ``zlib.crc32`` otherwise (about 4-5
GiB/s per core); both give the same value, so a cache written with one is verified
with the other.

zlib's releases the GIL, but a running CRC is sequential: pieces of a buffer can be
summed apart and joined, because a CRC is linear over GF(2): appending ``n`` bytes
multiplies the first CRC by ``x^(8n)`` modulo the CRC polynomial before the second CRC
is added. :func:`crc32_combine` does that join (as zlib's ``crc32_combine``, which
Python's zlib does not expose), and :func:`crc32_of` maps zlib's CRC over fixed pieces
(a thread pool's ``map`` spreads them over cores) and joins the results in order: the
value is the one ``zlib.crc32`` gives the whole buffer, whatever runs the pieces.
ISA-L's holds the GIL and outruns any split, so with it :func:`crc32_of` takes one call.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Iterable

__all__ = ["crc32", "crc32_combine", "crc32_of", "CRC32_IMPLEMENTATION", "PIECE_BYTES"]

try:
    from isal.isal_zlib import crc32
except ImportError:  # no wheel for this platform: zlib's, the same value
    crc32 = zlib.crc32
CRC32_IMPLEMENTATION = "zlib" if crc32 is zlib.crc32 else "isal"

_POLY = 0xEDB88320  # x^32 + x^26 + ... + 1, bit-reversed: the polynomial's x^0 is the top bit
_X0 = 1 << 31  # the polynomial 1 in that bit order
PIECE_BYTES = 8 * 1024 * 1024


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (both in the reflected bit order)."""
    product = 0
    mask = _X0
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.cache
def _x_to_2_to_the(k: int) -> int:
    """x^(2^k) modulo the polynomial."""
    if k == 0:
        return _X0 >> 1  # x^1
    half = _x_to_2_to_the(k - 1)
    return _multiply(half, half)


@functools.lru_cache(maxsize=64)
def _shift_of(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what appending ``nbytes`` bytes multiplies a CRC by."""
    power, k, bits = _X0, 3, nbytes  # 8 * nbytes = nbytes << 3
    while bits:
        if bits & 1:
            power = _multiply(_x_to_2_to_the(k), power)
        bits >>= 1
        k += 1
    return power


def crc32_combine(first: int, second: int, second_bytes: int) -> int:
    """The CRC-32 of A + B from ``first`` = CRC-32(A), ``second`` = CRC-32(B) and len(B)."""
    if second_bytes == 0:
        return first
    return _multiply(_shift_of(second_bytes), first) ^ second


def crc32_of(data, run: Callable[[Callable, Iterable], Iterable] = map) -> int:
    """``zlib.crc32(data)``: one call of :func:`crc32` where it is ISA-L's, else pieces of
    :data:`PIECE_BYTES` summed by ``run`` (``map`` or a thread pool's ``map``) and joined
    in order."""
    view = memoryview(data).cast("B")
    if crc32 is not zlib.crc32:
        return crc32(view)
    pieces = [view[start : start + PIECE_BYTES] for start in range(0, len(view), PIECE_BYTES)]
    value = 0
    for piece, crc in zip(pieces, run(zlib.crc32, pieces)):
        value = crc32_combine(value, crc, len(piece))
    return value
