"""What a weight that no checkpoint tensor holds was made from, for the spill's report.

A parameter with no checkpoint tensor of its name was made at or after load: fused
from checkpoint tensors (diffusers' ``fuse_qkv_projections()`` concatenates the rows
of ``to_q``, ``to_k`` and ``to_v`` into a new ``to_qkv``; a native class may fuse at
load) or computed (anything else). A spill keeps it either way; the report says which,
because a person deciding whether to keep a fusion wants to know what it costs.

Fusion is told from the bytes, never from names alone: the weight's rows, taken in
order, must equal whole checkpoint tensors of the same module (its siblings: the same
parent, the same leaf such as ``weight``, the same row shape and dtype), byte for byte.
"""

from __future__ import annotations

import math

import torch

from .same_bytes import same_bytes

__all__ = ["origin_of", "fused_from"]


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as ``(rows, rest)`` (a 1-D bias: one element a row)."""
    return tensor.detach().reshape(tensor.shape[0], -1) if tensor.dim() else tensor.detach().reshape(1, 1)


def fused_from(name: str, tensor: torch.Tensor, index) -> list[str] | None:
    """The checkpoint tensors whose rows, in order, make up ``tensor`` exactly, or None.

    ``name`` is the weight's name within its component (``blocks.0.attn.to_qkv.weight``);
    ``index`` is the component's :class:`hostmem.remapping.checkpoint.CheckpointIndex`.
    """
    if tensor.dim() == 0 or not tensor.is_contiguous():
        return None
    siblings = index.siblings(name, tuple(tensor.shape[1:]), tensor.dtype)
    if len(siblings) < 2:
        return None
    rows, row_size = _rows(tensor), math.prod(tensor.shape[1:])
    parts, at = [], 0
    while at < rows.shape[0]:
        found = next((s for s in siblings if s.shape[0] <= rows.shape[0] - at
                      and same_bytes(rows[at: at + s.shape[0]], index.view(s).reshape(s.shape[0], row_size))), None)
        if found is None:
            return None
        parts.append(found.name)
        at += found.shape[0]
    return parts if len(parts) > 1 else None


def origin_of(reason: str, name: str, tensor: torch.Tensor, index) -> str:
    """What a weight left for the spill was: ``cast from <dtype>``, ``changed``,
    ``fused from <names>`` or ``computed``."""
    if reason == "cast":
        dtypes = sorted({str(c.dtype).removeprefix("torch.") for c in index.candidates(name, tuple(tensor.shape))})
        return f"cast from {'/'.join(dtypes)}"
    if reason == "changed":
        return "changed"
    parts = fused_from(name, tensor, index)
    return f"fused from {', '.join(parts)}" if parts else "computed"
