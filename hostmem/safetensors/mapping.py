"""Read-only mappings of safetensors files, and their headers without the weights.

safetensors' own loader maps a file private and writable: a stray write into a
weight silently copies the page and turns it anonymous. :func:`open_readonly` maps
the file ``PROT_READ``/``MAP_SHARED`` instead and hands out tensors that are views
into that mapping, so their resident pages are page cache the kernel can drop, and
a write faults (SIGSEGV) instead of costing memory. Providers map their files back
through here.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import warnings

import torch

from .dtypes import torch_dtypes
from ..file_writes import write_all, write_uncached_pieces
from .header import SafetensorsError, SafetensorsHeader, TensorInfo, read_header
from .writers import guard_foreign_writers

__all__ = [
    "DTYPES",
    "TensorInfo",
    "SafetensorsHeader",
    "SafetensorsError",
    "read_header",
    "ReadOnlySafetensors",
    "CopyOnWriteSafetensors",
    "open_readonly",
    "load_readonly",
    "save_file",
    "advise_huge_pages",
]

DTYPES: dict[str, torch.dtype] = torch_dtypes()
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def advise_huge_pages(mapping: mmap.mmap) -> None:
    """Ask the kernel to fault ``mapping`` in 2 MiB at a time (``MADV_HUGEPAGE``).

    For a file mapping whose pages are not yet cached, each fault then reads a 2 MiB
    folio and maps it with one page-table entry, where a mapping left to readahead ends
    up with smaller folios at the start of every file that it keeps while they stay
    cached: a pass over 48 layer files of 85 MiB took 1.3 s against 0.3 s. Without THP
    in the kernel (or on other systems) nothing changes.
    """
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        pass


class ReadOnlySafetensors:
    """A safetensors file mapped ``PROT_READ``; tensors are zero-copy views into it.

    The mapping lives as long as any tensor taken from it (there is nothing to close:
    the last view to go unmaps it). Writing into such a tensor raises SIGSEGV: that is
    the point (it would otherwise copy the page).
    """

    _FLAGS, _PROT = mmap.MAP_SHARED, mmap.PROT_READ

    def __init__(self, path: str | os.PathLike):
        self.header = read_header(path)
        self.path = self.header.path
        with open(self.path, "rb") as handle:
            if self.header.file_size == 0:
                raise SafetensorsError(f"{self.path}: empty file")
            self.stat = os.fstat(handle.fileno())  # the file mapped, whatever the path names later
            if (self.stat.st_size != self.header.file_size
                    or (self.stat.st_dev, self.stat.st_ino) != self.header.file_id):
                raise SafetensorsError(f"{self.path}: changed while it was being read (its header was read from "
                                       "another file, or another length, than the one now mapped); "
                                       "open it again once it is written")
            self._map = mmap.mmap(handle.fileno(), 0, flags=self._FLAGS, prot=self._PROT)
        advise_huge_pages(self._map)
        guard_foreign_writers()  # read-only weights handed out: catch writers

    def keys(self) -> list[str]:
        return list(self.header.tensors)

    def metadata(self) -> dict[str, str]:
        return dict(self.header.metadata)

    def get_tensor(self, name: str) -> torch.Tensor:
        """Return tensor ``name`` as a read-only view into the mapping."""
        try:
            info = self.header.tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        start = self.header.data_offset + info.begin
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.torch_dtype)
        with warnings.catch_warnings():
            # torch warns that the buffer is not writable; read-only is what we want.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=info.nbytes, offset=start)
        return flat.view(info.torch_dtype).reshape(info.shape)



class CopyOnWriteSafetensors(ReadOnlySafetensors):
    """A safetensors file mapped private and writable, as safetensors' own loader maps it:
    a page is the file's (page cache) until a write copies it (anonymous from then on).

    For state a model writes (a buffer: running statistics, a counter), where a
    read-only view would fault on the write; never for weights, whose stray writes
    should fault (:class:`ReadOnlySafetensors`).
    """

    _FLAGS, _PROT = mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE


def open_readonly(path: str | os.PathLike) -> ReadOnlySafetensors:
    """Map ``path`` read-only; see :class:`ReadOnlySafetensors`."""
    return ReadOnlySafetensors(path)


def load_readonly(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Return every tensor of ``path`` as a read-only view, by name."""
    mapped = ReadOnlySafetensors(path)
    return {name: mapped.get_tensor(name) for name in mapped.keys()}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (no numpy needed)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def save_file(
    tensors: dict[str, torch.Tensor],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
    fsync: bool = False,
    writeback: bool = False,
    direct: bool = False,
) -> int:
    """Write ``tensors`` to ``path`` in the safetensors format and return the bytes written.

    Streams each tensor's bytes straight from its memory (one CPU-contiguous tensor at
    a time), so writing a large layer needs no second copy; ``fsync=True`` makes the
    file durable before returning. ``writeback=True`` starts the disk on each chunk as
    it is written (for gigabytes written in a row: left to the kernel's thresholds, the
    writer fills the dirty limit, then waits on the disk in bursts; the demo's 5 GiB on
    a virtual disk, five runs each, interleaved: 12-42 s, median 19 s, so; 14-17 s this
    way). ``direct=True`` writes around the page cache instead, with O_DIRECT where the
    filesystem allows (whole pages, through one page-aligned staging buffer; the rest
    as usual): the file is then not cached, so read it back if it is wanted there (the
    demo measures which way is faster on the machine: ``hostmem.write_way``).
    The header is padded so the data starts 8-aligned.
    """
    path = os.fspath(path)
    prepared = {}
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        if tensor.dtype not in DTYPE_NAMES:
            raise SafetensorsError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store")
        tensor = tensor.to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        prepared[name] = tensor
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    if direct:
        with open(path, "wb") as handle:
            pieces = [struct.pack("<Q", len(raw)), raw, *(tensor_bytes(prepared[name]) for name in sorted(prepared))]
            write_uncached_pieces(handle.fileno(), path, pieces)
            if fsync:
                os.fsync(handle.fileno())
        return 8 + len(raw) + offset
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(raw)))
        handle.write(raw)
        if writeback:
            handle.flush()
            at = 8 + len(raw)
            for name in sorted(prepared):
                data = tensor_bytes(prepared[name])
                write_all(handle.fileno(), data, at, writeback=True)
                at += len(data)
        else:
            for name in sorted(prepared):
                handle.write(tensor_bytes(prepared[name]))
        handle.flush()
        if fsync:
            os.fsync(handle.fileno())
    return 8 + len(raw) + offset
