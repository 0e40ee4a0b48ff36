"""The merge math, in one place: base + sum of scaled up @ down (and full deltas).

The in-place path and the cached path both call :func:`merged_weight`, so the bytes
they produce are identical: the sum is taken in fp32 on a one-layer temporary on the
compute device (the GPU when there is one, else the CPU), in the order the adapters
were given, and cast back to the base dtype once, at the end. The commonest case, a
bf16 base and one bf16 adapter on the CPU, takes the same arithmetic in one pass with
no temporary (see :func:`sums_in_output`).

Variants whose merge is not ``W + scale * B @ A`` (DoRA's magnitude vectors, LoHa,
LoKr, ...) are refused with the key named: merging them as plain LoRA would be wrong
without any error.
"""

from __future__ import annotations

import functools
import math
import mmap
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Callable

import torch

from hostmem.safetensors_map import advise_huge_pages

__all__ = [
    "Delta",
    "Scratch",
    "UnsupportedAdapterError",
    "compute_device",
    "host_buffer",
    "lora_scale",
    "merged_weight",
    "row_blocks",
    "refuse_unsupported",
    "sums_in_output",
]

# Markers of adapter variants whose merge is not W + scale * B @ A.
_UNSUPPORTED = {
    "lora_magnitude_vector": "DoRA (magnitude vector)",
    "dora_scale": "DoRA (dora_scale)",
    "hada_w1_a": "LoHa",
    "hada_w1_b": "LoHa",
    "hada_w2_a": "LoHa",
    "hada_w2_b": "LoHa",
    "hada_t1": "LoHa",
    "hada_t2": "LoHa",
    "lokr_w1": "LoKr",
    "lokr_w1_a": "LoKr",
    "lokr_w1_b": "LoKr",
    "lokr_w2": "LoKr",
    "lokr_w2_a": "LoKr",
    "lokr_w2_b": "LoKr",
    "lokr_t2": "LoKr",
    "lora_mid": "LoCon with a Tucker core (lora_mid)",
    "lora_embedding_A": "embedding LoRA",
    "lora_embedding_B": "embedding LoRA",
    "ia3_l": "IA3",
    "oft_blocks": "OFT",
    "oft_r": "OFT",
    "w_norm": "norm adapter (w_norm)",
    "b_norm": "norm adapter (b_norm)",
}


class UnsupportedAdapterError(ValueError):
    """An adapter uses a variant this merge cannot reproduce; the message names the key."""


def refuse_unsupported(path: str, key: str) -> None:
    """Raise :class:`UnsupportedAdapterError` when ``key`` belongs to an unsupported variant."""
    for part in key.split(".")[-2:]:  # the variant's marker is the key's suffix
        variant = _UNSUPPORTED.get(part)
        if variant is not None:
            raise UnsupportedAdapterError(
                f"{path}: key {key!r} belongs to a {variant} adapter, which lora_cache does not "
                "merge (its weights are not W + scale * B @ A); convert it to plain LoRA or apply "
                "it at run time instead"
            )


def lora_scale(strength: float, alpha: float | None, rank: int, rslora: bool = False) -> float:
    """Return the factor of ``up @ down``: strength x alpha / rank (or / sqrt(rank) for rsLoRA).

    ``alpha`` defaults to the rank, so an adapter that stores none is scaled by its strength.
    """
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    alpha = float(rank) if alpha is None else float(alpha)
    return float(strength) * alpha / (math.sqrt(rank) if rslora else rank)


@dataclass(frozen=True)
class Delta:
    """One adapter's change to one parameter: ``scale * up @ down`` and/or ``diff_scale * diff``.

    ``up`` is (out, rank) or (out, rank, 1, 1); ``down`` is (rank, in) or (rank, in, kh, kw).
    ``source`` names the adapter file and key for error messages.
    """

    source: str
    up: torch.Tensor | None = None
    down: torch.Tensor | None = None
    scale: float = 1.0
    diff: torch.Tensor | None = None
    diff_scale: float = 1.0

    def check(self) -> None:
        """Refuse what ``up @ down`` cannot express, before any layer is merged."""
        if self.up is not None and self.up.dim() == 4 and tuple(self.up.shape[2:]) != (1, 1):
            raise UnsupportedAdapterError(
                f"{self.source}: conv LoRA with a {tuple(self.up.shape[2:])} up kernel is not "
                "supported (only 1x1 up kernels merge as B @ A)"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the parameter this delta fits."""
        if self.up is not None:
            return (self.up.shape[0], *self.down.shape[1:])
        return tuple(self.diff.shape)


def compute_device() -> torch.device:
    """The device merges run on: the GPU when there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


_PAGE = 4096


class Scratch:
    """One buffer, reused for every layer of a merge, handed out as views of any dtype.

    A fresh one-layer temporary per layer would be freed after each layer, and the C
    allocator may keep such freed blocks instead of returning them to the kernel;
    reusing one buffer keeps the merge's resident high-water mark one layer wide however
    many layers there are. It only grows, to the largest request; :meth:`release` gives
    it back at the end. On the CPU it is a mapping of its own (see :func:`host_buffer`),
    so its views start on a huge-page boundary and the vault can hand them to the disk
    with O_DIRECT in large requests.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else compute_device()
        self.release()

    def reserve(self, nbytes: int) -> None:
        """Grow the buffer to ``nbytes`` (call once with the largest layer to avoid regrowth)."""
        if nbytes > self.nbytes:
            self.release()  # free the old one first
            if self.device.type == "cpu":
                self._bytes = host_buffer(nbytes)
            else:
                self._bytes = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Return a view of ``shape`` and ``dtype`` over the buffer (its contents are garbage)."""
        nbytes = math.prod(shape) * dtype.itemsize
        self.reserve(nbytes)
        return self._bytes[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return self._bytes.numel()

    def release(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device)


_HUGE_PAGE = 2 * 1024 * 1024


def host_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` of fresh host memory as a uint8 tensor that starts on a 2 MiB boundary.

    A private anonymous mapping of its own, advised for transparent huge pages (where
    the kernel has them, in its ``madvise`` mode too): each 2 MiB of it is then one
    physically contiguous page, so an O_DIRECT write of it goes to the disk in large
    requests (about 3.3 MiB on a virtio disk that takes 4 MiB, against 0.5-1.6 MiB from
    a heap buffer of scattered 4 KiB pages, which ran that disk at 0.55-0.7 of its rate),
    and filling it takes one fault per 2 MiB instead of 512. Its pages go back to the
    kernel when the last view of it is gone (unmapped, never kept by the C allocator).
    """
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    length = -(-nbytes // _PAGE) * _PAGE + _HUGE_PAGE  # room to start on the boundary
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    advise_huge_pages(mapping)  # a kernel without THP keeps 4 KiB pages: still correct
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGE_PAGE
    return whole[start : start + nbytes]


# Rows summed per block on the CPU: the block's fp32 accumulator (about this many bytes)
# stays in the core's cache from the copy of the base through every addmm to the cast.
_BLOCK_BYTES = 4 * 1024 * 1024


def _as_matrix(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device=device, dtype=torch.float32).flatten(1)


@dataclass(frozen=True)
class _Term:
    """One delta, made ready for the fp32 sum on the compute device (converted once per layer)."""

    up: torch.Tensor | None  # fp32 (rows, rank)
    down: torch.Tensor | None  # fp32 (rank, cols)
    scale: float
    diff: torch.Tensor | None
    diff_scale: float

    @classmethod
    def of(cls, delta: Delta, device: torch.device) -> "_Term":
        if delta.up is None:
            up = down = None
        else:
            delta.check()
            up, down = _as_matrix(delta.up, device), _as_matrix(delta.down, device)
        diff = None if delta.diff is None else delta.diff.to(device)
        return cls(up, down, delta.scale, diff, delta.diff_scale)


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


def sums_in_output(base: torch.Tensor, deltas: list[Delta], out: torch.Tensor, device: torch.device) -> bool:
    """Whether :func:`merged_weight` writes this merge straight into ``out``, in one pass.

    So it does for a bf16 base merged on the CPU with one LoRA term whose factors are
    bf16 (no second adapter, no full delta), when torch's bf16 addmm rounds once (see
    :func:`_bf16_addmm_rounds_once`): the kernel then does the merge's own arithmetic,
    exact products summed in fp32, the base added in fp32, one rounding to bf16, several
    times faster than an fp32 addmm and with no fp32 temporary at all. Otherwise the sum
    runs in :func:`merged_weight`'s fp32 scratch and only its final cast writes ``out``.
    A caller that overlaps layers needs to know which buffers a layer writes.
    """
    on_cpu = device.type == base.device.type == out.device.type == "cpu"
    if not on_cpu or base.dtype != torch.bfloat16 or base.dim() < 2 or not out.is_contiguous():
        return False
    if len(deltas) != 1 or deltas[0].up is None or deltas[0].diff is not None:
        return False
    delta = deltas[0]
    return delta.up.dtype == delta.down.dtype == torch.bfloat16 and _bf16_addmm_rounds_once()


def _add_block_in_output(out: torch.Tensor, base: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                         scale: float, rows: slice) -> None:
    """out[rows] = base[rows] + scale * up[rows] @ down, summed in fp32 by the kernel, rounded once."""
    block = out[rows]
    if block.data_ptr() != base[rows].data_ptr():  # an in-place merge adds into base itself
        block.copy_(base[rows])
    block.view(block.shape[0], -1).addmm_(up[rows], down, alpha=scale)


def _sum_block(acc: torch.Tensor, base: torch.Tensor, terms: list[_Term], rows: slice) -> None:
    """acc[rows] = base[rows] + every term's rows, in fp32, in the order given."""
    block = acc[rows]
    block.copy_(base[rows] if base.device == acc.device else base[rows].to(acc.device))
    for term in terms:
        if term.up is not None:
            block.view(block.shape[0], -1).addmm_(term.up[rows], term.down, alpha=term.scale)
        if term.diff is not None:
            block.add_(term.diff[rows], alpha=term.diff_scale)


def _cast_block(out: torch.Tensor, acc: torch.Tensor, rows: slice) -> None:
    out[rows].copy_(acc[rows] if acc.device == out.device else acc[rows].to(out.dtype))


def _block_ends(shape: tuple[int, ...], itemsize: int, blocks: list[slice]) -> list[int]:
    """Where each block's bytes end in a contiguous tensor of ``shape``."""
    row_bytes = itemsize * math.prod(shape[1:]) if shape else itemsize
    return [rows.stop * row_bytes for rows in blocks]


def merged_weight(
    base: torch.Tensor,
    deltas: list[Delta],
    out: torch.Tensor,
    scratch: Scratch,
    workers: Executor | None = None,
    claim: Callable[[int], None] | None = None,
    publish: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Write ``base + sum(deltas)`` into ``out`` (base's dtype and shape) and return ``out``.

    The sum runs in fp32 on ``scratch``'s device, in the row blocks of
    :func:`row_blocks`; only the final cast writes ``out``. ``out`` may be ``base``
    itself (a writable in-place merge): each block of base is read into the accumulator
    before that block of ``out`` is written. Where :func:`sums_in_output` says so, the
    same arithmetic runs in one pass straight into ``out`` and ``scratch`` is not
    touched. ``workers`` spreads the blocks over a thread pool (torch releases the GIL);
    the bytes do not depend on it.

    For a caller that streams ``out`` to disk while it is computed (see
    :mod:`lora_cache.handoff`), ``out`` must be contiguous: ``claim(end)`` is called
    before a block writes ``out``'s bytes up to ``end`` (and may wait until they are
    free), and ``publish(end)`` once bytes ``[0, end)`` of ``out`` are final, in order.
    """
    if out.shape != base.shape or out.dtype != base.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype}, base is {tuple(base.shape)} {base.dtype}")
    if (claim is not None or publish is not None) and not out.is_contiguous():
        raise ValueError("a streamed merge needs a contiguous out")
    run = map if workers is None else workers.map
    claim = claim or (lambda end: None)
    publish = publish or (lambda end: None)
    if sums_in_output(base, deltas, out, scratch.device):
        delta = deltas[0]
        delta.check()
        up, down = delta.up.flatten(1), delta.down.flatten(1)
        blocks = row_blocks(tuple(base.shape), scratch.device)
        ends = _block_ends(tuple(base.shape), out.element_size(), blocks)

        def one_block(i: int) -> int:
            claim(ends[i])
            _add_block_in_output(out, base, up, down, delta.scale, blocks[i])
            return ends[i]

        for end in run(one_block, range(len(blocks))):
            publish(end)  # in order: the map yields the blocks as they were given
        return out
    result = out
    acc = scratch.take(tuple(base.shape), torch.float32)
    terms = [_Term.of(delta, acc.device) for delta in deltas]
    if base.dim() == 0:  # a scalar parameter: one block of one row
        acc, base, out = acc.view(1), base.view(1), out.view(1)
        terms = [replace(t, diff=None if t.diff is None else t.diff.view(1)) for t in terms]
    blocks = row_blocks(tuple(base.shape), acc.device)
    ends = _block_ends(tuple(base.shape), out.element_size(), blocks)
    for _ in run(lambda rows: _sum_block(acc, base, terms, rows), blocks):
        pass  # drains the map, so an error in any block is raised here

    def cast_block(i: int) -> int:
        claim(ends[i])
        _cast_block(out, acc, blocks[i])
        return ends[i]

    for end in run(cast_block, range(len(blocks))):
        publish(end)
    return result
