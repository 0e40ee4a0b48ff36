"""The merge math, in one place: base + sum of scaled up @ down (and full deltas).

The in-place path and the cached path both call :func:`merged_weight`, so the bytes
they produce are identical. Two kernels compute a layer, both in the row blocks of
:func:`row_blocks`, each adding the same numbers in a fixed order and rounding once:

- :data:`FP32_ROWS`, every case: each block of the base is copied into an fp32
  accumulator of one block, the terms are added in the order the adapters were given,
  and the block is cast back to the base dtype once;
- :data:`BF16_ADDMM`, a bf16 base with one bf16 LoRA on the CPU: torch's bf16 addmm
  writes the block straight into the output, fp32 inside, one rounding.

They can differ in the last bit of a few elements (the matrix kernels order the rank's
products differently), so the choice is never left to chance: :mod:`lora_cache.kernels`
picks one by timing both on the machine, remembers it, and the cache key names it.

DoRA is merged as peft's ``merge_and_unload`` merges it: ``W' = m / ||W + s B A|| *
(W + s B A)``, the norm taken over each output row (the DoRA paper's column norm of
``W^T``), in fp32 and rounded once with the rest of the sum. The norm is a row's own,
so it fits the row blocks as they are. Several adapters apply in the order given, as
peft merges adapters one after another: each DoRA term's factor scales what the terms
before it made plus its own change, its norm that of the base plus its own change
alone (``W_k = m_k / ||W_0 + s_k B_k A_k|| * (W_{k-1} + s_k B_k A_k)``, peft's
``_unmerged_base_weight``).

LyCORIS's factored changes (LoHa, LoKr, LoCon's Tucker core) are terms of their own: each
row block asks them for its rows of the change (:mod:`lora_cache.terms.lycoris_math`), added with
the term's scale where a pair's ``up @ down`` would be. Other variants whose merge is not a
sum of such terms (IA3, OFT, ...) are refused with the key named
(:mod:`lora_cache.adapters.formats.refused`): merging them as plain LoRA would be wrong
without any error.
"""

from __future__ import annotations

import functools
import math
import queue
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ..adapters.spec import UnsupportedAdapterError
from .buffers import Scratch, compute_device, host_buffer
from ..terms.delta import Delta, lora_scale
from ..terms.dora_lycoris import COLUMNS, PEFT, add_decomposed, column_scale, peft_dora_after_others
from ..terms.lycoris_math import Prepared

__all__ = [
    "Accumulators",
    "BF16_ADDMM",
    "FP32_ROWS",
    "Delta",
    "Scratch",
    "Term",
    "UnsupportedAdapterError",
    "add_terms",
    "column_scales",
    "compute_device",
    "host_buffer",
    "lora_scale",
    "merged_weight",
    "one_pass_applies",
    "one_pass_kind",
    "one_pass_possible",
    "row_blocks",
    "scratch_bytes",
    "sums_in_output",
]

FP32_ROWS = "fp32-rows"  # fp32 accumulator per row block, terms in order, one cast: every case
BF16_ADDMM = "bf16-addmm"  # torch's bf16 addmm into the output, fp32 inside, one rounding


# Rows summed per block on the CPU: the block's fp32 accumulator (about this many bytes)
# stays in the core's cache from the copy of the base through every addmm to the cast.
_BLOCK_BYTES = 4 * 1024 * 1024


def _as_matrix(tensor: torch.Tensor, device: torch.device, fp32: bool = True) -> torch.Tensor:
    return tensor.to(device=device, dtype=torch.float32 if fp32 else tensor.dtype).flatten(1)


@dataclass(frozen=True)
class Term:
    """One delta, made ready for the sum on the compute device (converted once per layer):
    its factors in fp32, or in their own dtype for the one-pass kernel (``fp32=False``)."""

    up: torch.Tensor | None  # fp32 (rows, rank)
    down: torch.Tensor | None  # fp32 (rank, cols)
    scale: float
    diff: torch.Tensor | None
    diff_scale: float
    magnitude: torch.Tensor | None = None  # fp32 (rows,): DoRA
    dora: str = PEFT
    dora_strength: float = 1.0
    columns: torch.Tensor | None = None  # fp32 (cols,): a column-axis DoRA's factors (column_scales)
    factors: Prepared | None = None  # a LyCORIS factored change, fp32 on the device

    @classmethod
    def of(cls, delta: Delta, device: torch.device, fp32: bool = True, columns: torch.Tensor | None = None) -> "Term":
        if delta.up is None:
            up = down = None
        else:
            delta.check()
            up, down = _as_matrix(delta.up, device, fp32), _as_matrix(delta.down, device, fp32)
        diff = None if delta.diff is None else delta.diff.to(device)
        magnitude = None if delta.magnitude is None else delta.magnitude.to(device=device, dtype=torch.float32)
        factors = None if delta.factors is None else delta.factors.prepared(device)
        return cls(up, down, delta.scale, diff, delta.diff_scale, magnitude, delta.dora, delta.dora_strength, columns,
                   factors)

    def add_product(self, flat: torch.Tensor, rows: slice) -> None:
        """flat (a row block, 2-D) += scale * this term's pair or factored change on ``rows``."""
        if self.factors is not None:
            self.factors.add_to(flat, rows, self.scale)
        else:
            flat.addmm_(self.up[rows], self.down, alpha=self.scale)


def row_blocks(shape: tuple[int, ...], device: torch.device) -> list[slice]:
    """The row ranges a layer's sum is taken in: cache-sized blocks on the CPU, one on a GPU.

    Fixed by the shape alone, so every merge of a layer (cached or in place, on one
    thread or several) adds the same numbers in the same order and gives the same bytes.
    """
    rows = shape[0] if shape else 1
    if device.type != "cpu":
        return [slice(0, rows)]
    row_bytes = 4 * math.prod(shape[1:])
    step = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


@functools.cache
def _bf16_addmm_rounds_once() -> bool:
    """Whether torch's CPU bf16 addmm takes the products, their sum and the add of the
    base in fp32 and rounds once, at the end, as the merge must (oneDNN's kernels and
    torch's own do; a kernel that rounded the product first would not).

    Told by one case: 1 + 0.5 * (2**-7 + 2**-15) = 1 + 2**-8 + 2**-16 lies just above
    the midpoint of the bf16 neighbours 1 and 1 + 2**-7, so rounding once gives the
    upper one; rounding the product (or the partial sum) to bf16 first lands exactly on
    the midpoint, which rounds to even: 1.
    """
    rows, cols, rank = 16, 256, 64
    base = torch.ones(rows, cols, dtype=torch.bfloat16)
    up = torch.zeros(rows, rank, dtype=torch.bfloat16)
    down = torch.zeros(rank, cols, dtype=torch.bfloat16)
    up[:, :2] = 1
    down[0], down[1] = 2.0**-7, 2.0**-15
    base.addmm_(up, down, alpha=0.5)
    return bool((base == 1 + 2.0**-7).all())


def one_pass_applies(dtype: torch.dtype, ndim: int, deltas: list[Delta], device: torch.device | str) -> bool:
    """Whether :data:`BF16_ADDMM` computes a layer of this kind exactly as the merge must.

    So it does for a bf16 base of two or more dimensions merged on the CPU with one LoRA
    term whose factors are bf16 (no second adapter, no full delta), when torch's bf16
    addmm rounds once (see :func:`_bf16_addmm_rounds_once`): the kernel then does the
    merge's own arithmetic, exact products summed in fp32, the base added in fp32, one
    rounding to bf16. Whether it is faster than :data:`FP32_ROWS` depends on the CPU
    (several times faster with AVX512-BF16 or AMX, several times slower with AVX2
    alone): that is measured, not assumed (see :mod:`lora_cache.kernels`).
    """
    return one_pass_kind(dtype, ndim, deltas, device) and _bf16_addmm_rounds_once()


def one_pass_kind(dtype: torch.dtype, ndim: int, deltas: list[Delta], device: torch.device | str) -> bool:
    """Whether a layer is of the kind :data:`BF16_ADDMM` can sum (see :func:`one_pass_applies`),
    before asking how torch's addmm rounds: a plan that knows the answer already (the
    kernel wisdom keeps it) spares a start its first bf16 addmm."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or ndim < 2:
        return False
    if len(deltas) != 1 or deltas[0].up is None or deltas[0].diff is not None or deltas[0].magnitude is not None:
        return False
    delta = deltas[0]
    return delta.up.dtype == delta.down.dtype == torch.bfloat16


def one_pass_possible(base: torch.Tensor, deltas: list[Delta], out: torch.Tensor, device: torch.device) -> bool:
    """Whether :data:`BF16_ADDMM` can write this merge straight into ``out`` (both on the CPU,
    ``out`` contiguous, a layer of the kind :func:`one_pass_applies` names)."""
    if not base.device.type == out.device.type == "cpu" or not out.is_contiguous():
        return False
    return one_pass_applies(base.dtype, base.dim(), deltas, device)


def sums_in_output(base: torch.Tensor, deltas: list[Delta], out: torch.Tensor, device: torch.device,
                   kernel: str = BF16_ADDMM) -> bool:
    """Whether :func:`merged_weight` with ``kernel`` writes this merge straight into ``out``
    and needs no fp32 accumulator (a caller that sizes buffers needs to know)."""
    return kernel == BF16_ADDMM and one_pass_possible(base, deltas, out, device)


def _add_block_in_output(out: torch.Tensor, base: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                         scale: float, rows: slice) -> None:
    """out[rows] = base[rows] + scale * up[rows] @ down, summed in fp32 by the kernel, rounded once."""
    block = out[rows]
    if block.data_ptr() != base[rows].data_ptr():  # an in-place merge adds into base itself
        block.copy_(base[rows])
    block.view(block.shape[0], -1).addmm_(up[rows], down, alpha=scale)


def _sum_block(acc: torch.Tensor, base: torch.Tensor, terms: list[Term], rows: slice) -> None:
    """acc = base[rows] + every term's rows, in fp32, in the order given (acc: one block)."""
    acc.copy_(base[rows] if base.device == acc.device else base[rows].to(acc.device))
    add_terms(acc, terms, rows)


def add_terms(block: torch.Tensor, terms: list[Term], rows: slice) -> None:
    """block += every term's ``rows``, in the order given (block: one row block of the base
    on entry); a peft DoRA term then rescales each row to its magnitude over the norm of
    that row of the base plus its own change (peft's ``_unmerged_base_weight``: the terms
    before it do not enter its norm, though its factor scales what they made), a LyCORIS
    one as :mod:`lora_cache.terms.dora_lycoris` says."""
    base = block.clone() if peft_dora_after_others(terms) else None
    for i, term in enumerate(terms):
        if term.magnitude is not None and term.dora != PEFT:
            add_decomposed(block.view(block.shape[0], -1), functools.partial(term.add_product, rows=rows),
                           term.dora_strength, None if term.dora == COLUMNS else term.magnitude[rows], term.columns)
            continue
        _add_change(block, term, rows)
        if term.magnitude is not None:
            flat = block.view(block.shape[0], -1)
            own = flat
            if i > 0:  # the base and this term's change alone
                own = base.clone()
                _add_change(own, term, rows)
                own = own.view(own.shape[0], -1)
            flat.mul_((term.magnitude[rows] / torch.linalg.vector_norm(own, dim=1)).unsqueeze(1))


def _add_change(block: torch.Tensor, term: Term, rows: slice) -> None:
    if term.up is not None or term.factors is not None:
        term.add_product(block.view(block.shape[0], -1), rows)
    if term.diff is not None:
        block.add_(term.diff[rows], alpha=term.diff_scale)


def column_scales(base: torch.Tensor, deltas: list[Delta], device: torch.device) -> list[torch.Tensor | None]:
    """For each delta, its column-axis DoRA factors over the whole layer (None for the others):
    the columns' norms of the weight the terms before it and its own pair make, gathered in
    the merge's row blocks before any block is merged."""
    found: list[torch.Tensor | None] = [None] * len(deltas)
    if not any(d.magnitude is not None and d.dora == COLUMNS for d in deltas):
        return found
    terms = [Term.of(d, device) for d in deltas]
    flat_base = base.reshape(base.shape[0], -1)
    for i, term in enumerate(terms):
        if term.magnitude is None or term.dora != COLUMNS:
            continue
        sumsq = torch.zeros(flat_base.shape[1], dtype=torch.float32, device=device)
        for rows in row_blocks(tuple(flat_base.shape), device):
            block = flat_base[rows].to(device=device, dtype=torch.float32, copy=True)  # never a view of the base
            add_terms(block, terms[:i], rows)
            term.add_product(block, rows)
            sumsq += block.square().sum(dim=0)
        found[i] = column_scale(sumsq, term.magnitude)
        terms[i] = replace(term, columns=found[i])
    return found


def _block_ends(shape: tuple[int, ...], itemsize: int, blocks: list[slice]) -> list[int]:
    """Where each block's bytes end in a contiguous tensor of ``shape``."""
    row_bytes = itemsize * math.prod(shape[1:]) if shape else itemsize
    return [rows.stop * row_bytes for rows in blocks]


def _concurrency(workers: Executor | None) -> int:
    """How many blocks may be in flight at once: the pool's threads (one without a pool)."""
    if workers is None:
        return 1
    return int(getattr(workers, "threads", None) or getattr(workers, "_max_workers", None) or 32)


def scratch_bytes(shape: tuple[int, ...], device: torch.device, workers: Executor | None = None) -> int:
    """The fp32 accumulator :data:`FP32_ROWS` needs for a layer of ``shape``: one block per
    block in flight (on a GPU, the one block is the layer)."""
    blocks = row_blocks(tuple(shape), device)
    largest = max(b.stop - b.start for b in blocks) * math.prod(shape[1:])
    return min(len(blocks), _concurrency(workers)) * largest * 4


class Accumulators:
    """One fp32 block accumulator per block in flight, views of the scratch buffer.

    A block takes a free one and gives it back when cast, so a layer's fp32 temporary is
    a few cache-sized blocks, not the layer: the in-place path then grows by no more than
    the layer it writes, and the cached path touches less fresh memory.
    """

    def __init__(self, scratch: Scratch, shape: tuple[int, ...], blocks: list[slice], workers):
        self.per_row = math.prod(shape[1:])
        self.largest = max(b.stop - b.start for b in blocks) * self.per_row
        slots = min(len(blocks), _concurrency(workers))
        self.whole = scratch.take((slots, self.largest), torch.float32)
        self.free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(slots):
            self.free.put(slot)

    def take(self, rows: slice, shape: tuple[int, ...]) -> tuple[int, torch.Tensor]:
        slot = self.free.get()
        count = (rows.stop - rows.start) * self.per_row
        return slot, self.whole[slot, :count].view(rows.stop - rows.start, *shape[1:])

    def give_back(self, slot: int) -> None:
        self.free.put(slot)


def merged_weight(
    base: torch.Tensor,
    deltas: list[Delta],
    out: torch.Tensor,
    scratch: Scratch,
    workers: Executor | None = None,
    claim: Callable[[int], None] | None = None,
    publish: Callable[[int], None] | None = None,
    kernel: str = FP32_ROWS,
) -> torch.Tensor:
    """Write ``base + sum(deltas)`` into ``out`` (base's dtype and shape) and return ``out``.

    ``kernel`` says how (:data:`FP32_ROWS`, or :data:`BF16_ADDMM` where
    :func:`one_pass_possible`; elsewhere :data:`FP32_ROWS` runs). Either runs in the
    row blocks of :func:`row_blocks`; the fp32 one sums each block in an accumulator
    of ``scratch`` (one per block in flight) and casts it into ``out``. ``out`` may be
    ``base`` itself (a writable in-place merge): each block of base is read before
    that block of ``out`` is written. ``workers`` spreads the blocks over a thread
    pool (torch releases the GIL); the bytes do not depend on it.

    For a caller that streams ``out`` to disk while it is computed (see
    :mod:`hostmem.vault.handoff`), ``out`` must be contiguous: ``claim(end)`` is called
    before a block writes ``out``'s bytes up to ``end`` (and may wait until they are
    free), and ``publish(end)`` once bytes ``[0, end)`` of ``out`` are final, in order.
    """
    if out.shape != base.shape or out.dtype != base.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, base is {tuple(base.shape)} {base.dtype}")
    if (claim is not None or publish is not None) and not out.is_contiguous():
        raise ValueError("a streamed merge needs a contiguous out")
    run = map if workers is None else workers.map
    claim = claim or (lambda end: None)
    blocks = row_blocks(tuple(base.shape), scratch.device)
    ends = _block_ends(tuple(base.shape), out.element_size(), blocks)
    if sums_in_output(base, deltas, out, scratch.device, kernel):
        one_block = _one_pass_blocks(base, deltas[0], out, blocks, ends, claim)
    else:
        one_block = _fp32_blocks(base, deltas, out, scratch, workers, blocks, ends, claim)
    for end in run(one_block, range(len(blocks))):
        if publish is not None:
            publish(end)  # in order: the map yields the blocks as they were given
    return out


def _one_pass_blocks(base, delta: Delta, out, blocks, ends, claim) -> Callable[[int], int]:
    """The :data:`BF16_ADDMM` work of block ``i``: claim its bytes of ``out``, then add into them."""
    delta.check()
    up, down = delta.up.flatten(1), delta.down.flatten(1)

    def one_block(i: int) -> int:
        claim(ends[i])
        _add_block_in_output(out, base, up, down, delta.scale, blocks[i])
        return ends[i]

    return one_block


def _fp32_blocks(base, deltas, out, scratch, workers, blocks, ends, claim) -> Callable[[int], int]:
    """The :data:`FP32_ROWS` work of block ``i``: sum it in an fp32 accumulator (before its
    bytes of ``out`` are claimed, so the sum overlaps the wait), then cast it into ``out``."""
    device = scratch.device
    terms = [Term.of(delta, device, columns=c) for delta, c in zip(deltas, column_scales(base, deltas, device))]
    if base.dim() == 0:  # a scalar parameter: one block of one row
        base, out = base.view(1), out.view(1)
        terms = [replace(t, diff=None if t.diff is None else t.diff.view(1)) for t in terms]
    accumulators = Accumulators(scratch, tuple(base.shape), blocks, workers)

    def one_block(i: int) -> int:
        slot, acc = accumulators.take(blocks[i], tuple(base.shape))
        try:
            _sum_block(acc, base, terms, blocks[i])
            claim(ends[i])
            out[blocks[i]].copy_(acc if acc.device == out.device else acc.to(out.dtype))
        finally:
            accumulators.give_back(slot)
        return ends[i]

    return one_block
