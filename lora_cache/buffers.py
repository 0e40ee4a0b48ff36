"""Host buffers the merge reuses: one scratch for every layer, on huge pages of its own."""

from __future__ import annotations

import math
import mmap

import torch

from hostmem.safetensors.mapping import advise_huge_pages

__all__ = ["Scratch", "compute_device", "host_buffer"]


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
