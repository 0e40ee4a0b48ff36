"""Whether a file's pages are in the page cache, asked of the kernel itself.

mincore over a private mapping of the file that is never touched: a probing read would
start read-ahead, which fills the very pages it asks about.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest


def cached_pages(path: str) -> list[bool]:
    """Whether each page of ``path`` is in the page cache (nothing is read; skips where mincore is refused)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)  # private: never written
    try:
        anchor = ctypes.c_char.from_buffer(mapping)
        vector = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.addressof(anchor), size, vector) != 0:
            pytest.skip(f"mincore refused: {os.strerror(ctypes.get_errno())}")
        del anchor
        return [bool(v & 1) for v in vector]
    finally:
        mapping.close()
