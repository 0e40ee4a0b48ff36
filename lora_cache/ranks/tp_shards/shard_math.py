"""A shard's merged weight, equal byte for byte to that part of the whole layer's merge.

The rounding to the weight's dtype is elementwise, but the fp32 sum before it is not
always: a matrix kernel may order a rank's products differently for another width or
height (the tail tiles), so ``B[rows] @ A`` or ``B @ A[:, cols]`` of a shard alone
differed from the whole layer's product in the last bit of many elements here (fp32,
3072 x 3072, rank 64). So a shard is summed exactly as the whole layer is: in the whole
layer's row blocks (:func:`lora_cache.compute.merge_math.row_blocks` of its full shape), each
block at full width, the same matrix products on the same shapes, by the same kernel,
with the shard's base set into its place (the columns outside it hold zeros: each
element's sum depends on its own base element only). Only the shard's part of each
block is cast and kept, so the memory stays one full-width block per worker; a column
shard costs the whole layer's arithmetic, the price of bytes that match.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...terms.dora_lycoris import COLUMNS
from ...compute.merge_math import (BF16_ADDMM, FP32_ROWS, Accumulators, Delta, Scratch, Term, UnsupportedAdapterError, add_terms,
                          one_pass_applies, row_blocks)

# ``shard`` below is a :class:`lora_cache.ranks.tp_shards.spec.Shard`, named and not imported: the
# Shard calls this module (``Shard.merged``), so the layer operations can sum a part without
# knowing this room.

__all__ = ["shard_merged"]


def _refuse_dora_apart(deltas: list[Delta], shard: "Shard") -> None:
    """A DoRA term norms whole rows (peft's; LyCORIS's row axis) or whole columns over every
    row (LyCORIS's input axis, :mod:`lora_cache.terms.dora_lycoris`): a part that lacks them
    cannot be merged alone without normalising by the wrong norms."""
    for delta in deltas:
        if delta.magnitude is not None and (shard.dim == 1 or delta.dora == COLUMNS):
            lacks = "the other columns of its rows" if shard.dim == 1 else "the other rows of its columns"
            raise UnsupportedAdapterError(
                f"{delta.source}: a DoRA term on a part of the weight along dim {shard.dim}, which lacks {lacks} "
                "its norms need; merge it on the whole weight (no shards= for this parameter)"
            )


def shard_merged(base: torch.Tensor, deltas: list[Delta], shard: "Shard", out: torch.Tensor, scratch: Scratch,
                 workers=None, claim: Callable[[int], None] | None = None,
                 publish: Callable[[int], None] | None = None, kernel: str = FP32_ROWS) -> torch.Tensor:
    """Write ``shard``'s part of the whole layer's merge into ``out`` and return ``out``.

    ``base`` is the part the rank holds, ``deltas`` the whole layer's (made for the full
    shape), ``kernel`` the one the whole layer is summed by. ``claim`` and ``publish``
    stream ``out`` as :func:`lora_cache.compute.merge_math.merged_weight` does; ``out`` may be
    ``base`` (each block reads its rows of ``base`` before it writes them).
    """
    full = tuple(deltas[0].shape)
    if shard.full_shape(tuple(base.shape)) != full or out.shape != base.shape or out.dtype != base.dtype:
        raise ValueError(f"a shard {tuple(shard)} of {full}: base is {tuple(base.shape)}, out {tuple(out.shape)}")
    _refuse_dora_apart(deltas, shard)
    device = scratch.device
    own = shard.bounds(full)
    rows = own if shard.dim == 0 else slice(0, full[0])
    blocks = row_blocks(full, device)
    work = [b for b in blocks if b.start < rows.stop and rows.start < b.stop]
    one_pass = kernel == BF16_ADDMM and one_pass_applies(base.dtype, len(full), deltas, device)
    terms = [Term.of(d, device, fp32=not one_pass) for d in deltas]
    accumulators = Accumulators(scratch, full, blocks, workers)  # every block: the whole layer's slots
    row_bytes = out.element_size() * out[0].numel() if out.dim() else out.element_size()
    claim = claim or (lambda end: None)

    def one_block(i: int) -> int:
        block_rows = work[i]
        lo, hi = max(block_rows.start, rows.start), min(block_rows.stop, rows.stop)
        slot, acc = accumulators.take(block_rows, full)
        try:  # the one-pass kernel adds in the weight's dtype: its block is the slot's first bytes
            block = acc.view(-1).view(base.dtype)[: acc.numel()].view(acc.shape) if one_pass else acc
            block.zero_()
            mine = block[lo - block_rows.start : hi - block_rows.start]
            if shard.dim == 1:
                mine = mine.narrow(1, own.start, own.stop - own.start)
            mine.copy_(base[lo - rows.start : hi - rows.start])
            add_terms(block, terms, block_rows)
            claim((hi - rows.start) * row_bytes)
            out[lo - rows.start : hi - rows.start].copy_(mine)
        finally:
            accumulators.give_back(slot)
        return (hi - rows.start) * row_bytes

    run = map if workers is None else workers.map
    for end in run(one_block, range(len(work))):
        if publish is not None:
            publish(end)
    return out
