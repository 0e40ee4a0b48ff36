"""Host buffers the merge reuses: one scratch for every layer, on huge pages of its own."""

from __future__ import annotations

import math
import mmap

import torch

from hostmem.safetensors.mapping import advise_huge_pages

__all__ = ["PAGE", "RING_BYTES", "Scratch", "claim_after", "compute_device", "host_buffer", "ring_bytes"]


def compute_device(weight: torch.Tensor | None = None) -> torch.device:
    """Where a merge sums ``weight`` unless told otherwise: where it lies. A host weight
    (every weight the cache holds) on the CPU, a GPU-resident one on its GPU.

    A GPU host sums host weights on the CPU too. Sent to the GPU, every layer crosses the
    bus twice, the write and its checksum stay on the CPU anyway, and the first merge
    starts CUDA in a process that may not have yet, about 140 MiB of anonymous host
    memory of CUDA's own: on a 16-core host with an H200, a 1 GiB build took 1.30 s and
    11 core-seconds through the GPU against 0.94 s and 3.7 core-seconds on the CPU.
    ``merge(device="cuda")`` still sends them there.
    """
    if weight is not None and weight.device.type != "cpu":
        return weight.device
    return torch.device("cpu")


PAGE = 4096
# The output buffer is a ring that holds several layers where they are small: a layer's
# sum then overwrites bytes whose write ended a few layers ago, not the layer just before
# (whose last piece, and the open, fallocate and first write of its file, the sum of a
# one-layer buffer waited for). Measured on a 2-core virtual machine with 512 layers of
# 2 MiB, each layer's sum waited ~5 ms for the one before (2.5 s of a 1 GiB build). A
# fresh page costs ~5 ms per MiB to touch there, so the ring is no larger than it needs.
RING_BYTES = 16 * 1024 * 1024


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

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, at: int = 0) -> torch.Tensor:
        """Return a view of ``shape`` and ``dtype`` over the buffer from byte ``at`` (a page
        boundary, or 0; its contents are garbage)."""
        nbytes = math.prod(shape) * dtype.itemsize
        self.reserve(at + nbytes)
        return self._bytes[at : at + nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return self._bytes.numel()

    def release(self) -> None:
        self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device)


_HUGEPAGE = 2 * 1024 * 1024


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
    length = -(-nbytes // PAGE) * PAGE + _HUGEPAGE  # room to start on the boundary
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    advise_huge_pages(mapping)  # a kernel without THP keeps 4 KiB pages: still correct
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % _HUGEPAGE
    return whole[start : start + nbytes]


def claim_after(earlier: list, end: int, at: int = 0) -> None:
    """Wait until every layer in ``earlier`` has written its bytes that ``[at, at + end)`` of
    the ring covers (a block may overwrite them then). Each of ``earlier`` is a handoff
    whose bytes start at the ring's start, or ``(offset, handoff)``; a layer's bytes are
    handed back in order from its start, so one below ``at`` is waited for up to the end."""
    for layer in earlier:
        offset, handoff = layer if isinstance(layer, tuple) else (0, layer)
        if offset < at + end and at < offset + handoff.nbytes:
            handoff.wait_released(at + end - offset)


def ring_bytes(sizes: list[int]) -> int:
    """The output buffer for layers of ``sizes`` bytes: the largest layer, or where every
    layer is small (a quarter of :data:`RING_BYTES` at most), a ring of up to
    :data:`RING_BYTES` that holds several of them (each starting on a page). The
    anonymous memory a build adds stays one layer wide, or :data:`RING_BYTES`."""
    largest = max(sizes, default=0)
    if 4 * largest > RING_BYTES:
        return largest
    return max(largest, min(sum(-(-n // PAGE) * PAGE for n in sizes), RING_BYTES))
