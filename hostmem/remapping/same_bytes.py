"""Exact byte equality of two tensors, fast: what remap and the origin of a fused weight compare with.

Below both (:mod:`hostmem.remapping.checkpoint`, :mod:`hostmem.remapping.origin`), so neither
imports the other for it.
"""

from __future__ import annotations

import torch

__all__ = ["same_bytes"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact byte equality of two contiguous tensors, in one pass over the widest integers
    that tile both (int64 where their addresses and sizes allow: 3x faster than int16)."""
    a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    if a.numel() != b.numel():
        return False
    width = next(w for w in (8, 4, 2, 1) if a.numel() % w == 0 and a.data_ptr() % w == 0 and b.data_ptr() % w == 0)
    return torch.equal(a.view(_INT_OF_SIZE[width]), b.view(_INT_OF_SIZE[width]))
