"""Where the bytes of an address range live: the residency classifier.

Each page of a range is put in exactly one class:

- ``anonymous``: resident and backed by no file the kernel can re-read (heap, torch
  allocations, a copy-on-write page of a private file mapping);
- ``file_backed``: a resident page of a file on a real filesystem (reclaimable);
- ``shmem``: a page of a tmpfs or /dev/shm file, or shared anonymous memory
  (file-backed in name, NOT reclaimable without swap);
- ``pinned``: in an mlocked area (smaps ``Locked``, VmFlags ``lo``) or in a mapping of a
  GPU driver's device file (memory from cudaHostAlloc lives there);
- ``swapped``: written out to swap;
- ``not_resident``: mapped but not faulted in (costs nothing now).

The class is decided per page from pagemap bits, not per area: a private file mapping
whose pages were partly written shows exactly those pages as anonymous. Byte counts are
exact for ranges that do not start or end on a page boundary: a page shared by two
tensors is split between them by the bytes each one covers.
"""

from __future__ import annotations

import bisect
from dataclasses import fields

import torch

from .pagemap import PagemapReader
from .procfs import (
    PAGE_SIZE,
    Mount,
    ProcReadError,
    Vma,
    is_shmem_fs,
    read_maps,
    read_mounts,
    read_smaps,
    read_status,
)
from .residency_classes import CLASSES, Residency

__all__ = ["Residency", "RangeClassifier", "classify_range", "CLASSES"]

_ANONYMOUS, _FILE_BACKED, _SHMEM, _PINNED, _SWAPPED, _NOT_RESIDENT = range(len(CLASSES))

_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd")
_SHMEM_NAMES = ("/SYSV", "/memfd:", "/dev/zero", "[anon_shmem")


def _strip_deleted(path: str) -> str:
    return path[: -len(" (deleted)")] if path.endswith(" (deleted)") else path


class _AreaKind:
    DEVICE = "device"
    LOCKED = "locked"
    SHMEM_SHARED = "shmem_shared"  # every present page is shmem
    FILE = "file"  # present pages: file bit -> file_backed, else anonymous
    SHMEM_FILE = "shmem_file"  # private tmpfs mapping: file bit -> shmem, else anonymous
    ANON = "anon"  # present pages: shared bit -> shmem, else anonymous


class RangeClassifier:
    """A snapshot of one process's memory areas that classifies address ranges.

    Reads smaps and mountinfo once, keeps pagemap open, and answers many
    :meth:`classify` calls cheaply. Take a new one after the process maps or locks
    more memory. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, pid: int | None = None):
        self.pid = pid
        self._mounts: list[Mount] = read_mounts(pid)
        self._fs_cache: dict[str, bool] = {}
        try:
            self._pagemap: PagemapReader | None = PagemapReader(pid)
            self.precision = "page"
        except ProcReadError:
            # Another user's process: smaps is readable, pagemap is not. Classify per
            # area from smaps' Anonymous/Rss/Swap, pro-rated for partial ranges.
            self._pagemap = None
            self.precision = "vma"
        # smaps costs a page-table walk (tens of ms per resident GiB); it is only needed
        # for VmFlags when something is locked, or for counters when pagemap is closed.
        needs_smaps = self._pagemap is None or read_status(pid).vm_lck > 0
        self.vmas: list[Vma] = read_smaps(pid) if needs_smaps else read_maps(pid)
        self._starts = [v.start for v in self.vmas]

    def close(self) -> None:
        if self._pagemap is not None:
            self._pagemap.close()

    def __enter__(self) -> "RangeClassifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_shmem_fs(self, path: str) -> bool:
        cached = self._fs_cache.get(path)
        if cached is None:
            cached = self._fs_cache[path] = is_shmem_fs(_strip_deleted(path), self._mounts)
        return cached

    def area_kind(self, vma: Vma) -> str:
        """Return how pages of ``vma`` are classified (one of :class:`_AreaKind`)."""
        path = vma.path or ""
        if path.startswith(_DEVICE_PREFIXES):
            return _AreaKind.DEVICE
        if vma.is_locked:
            return _AreaKind.LOCKED
        if path.startswith(_SHMEM_NAMES):
            return _AreaKind.SHMEM_SHARED
        if vma.is_file and path.startswith("/"):
            if self._on_shmem_fs(path):
                return _AreaKind.SHMEM_SHARED if vma.is_shared else _AreaKind.SHMEM_FILE
            return _AreaKind.FILE
        return _AreaKind.ANON

    def classify(self, start: int, end: int) -> Residency:
        """Return the residency of the bytes ``[start, end)``; unmapped bytes are skipped."""
        return self.classify_many([(start, end)])[0]

    def classify_area(self, vma: Vma) -> Residency:
        """Return the residency of a whole area."""
        return self.classify_many([(vma.start, vma.end)])[0]

    def classify_many(self, ranges: list[tuple[int, int]]) -> list[Residency]:
        """Classify many ranges at once: one pagemap read per area, prefix sums per range.

        This is what keeps accounting a 2,000-parameter model in milliseconds: the cost
        is one pass over the pages plus a few tensor operations, not a call per range.
        """
        out = torch.zeros(len(ranges), len(CLASSES), dtype=torch.int64)
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for index, (start, end) in enumerate(ranges):
            for area in self._overlapping_indices(start, end):
                vma = self.vmas[area]
                pieces.setdefault(area, []).append((index, max(start, vma.start), min(end, vma.end)))
        for area, items in pieces.items():
            vma = self.vmas[area]
            kind = self.area_kind(vma)
            if self._pagemap is None and kind != _AreaKind.DEVICE:
                for index, start, end in items:
                    out[index] += torch.tensor(_as_row(_classify_from_smaps(vma, kind, start, end)))
                continue
            index, sums = self._sum_pieces(vma, kind, items)
            out.index_add_(0, index, sums)
        return [Residency(*row) for row in out.tolist()]

    def _overlapping_indices(self, start: int, end: int) -> list[int]:
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        found = []
        while i < len(self.vmas) and self.vmas[i].start < end:
            if self.vmas[i].end > start:
                found.append(i)
            i += 1
        return found

    def _sum_pieces(self, vma: Vma, kind: str, items: list[tuple[int, int, int]]):
        """Bytes per class of each piece, from the page codes of the span they cover."""
        base = min(s for _, s, _ in items) // PAGE_SIZE * PAGE_SIZE
        top = max(e for _, _, e in items)
        codes = self._page_codes(vma, kind, base, top)
        counts = torch.zeros(codes.numel() + 1, len(CLASSES), dtype=torch.int64)
        for code in torch.unique(codes).tolist():  # usually one or two classes per area
            counts[1:, code] = (codes == code).to(torch.int32).cumsum(0)
        index = torch.tensor([i for i, _, _ in items], dtype=torch.int64)
        # Offsets from the span's first page: kernel addresses do not fit an int64.
        starts = torch.tensor([s - base for _, s, _ in items], dtype=torch.int64)
        ends = torch.tensor([e - base for _, _, e in items], dtype=torch.int64)
        first = starts // PAGE_SIZE
        stop = (ends + PAGE_SIZE - 1) // PAGE_SIZE
        sums = (counts[stop] - counts[first]) * PAGE_SIZE
        rows = torch.arange(len(items))
        # Partial first and last pages: take off the bytes outside the piece.
        sums[rows, codes[first]] -= starts - first * PAGE_SIZE
        sums[rows, codes[stop - 1]] -= stop * PAGE_SIZE - ends
        return index, sums

    def _page_codes(self, vma: Vma, kind: str, start: int, end: int) -> torch.Tensor:
        """One class code (an index into CLASSES) per page of ``[start, end)``."""
        pages = (end - start + PAGE_SIZE - 1) // PAGE_SIZE
        if kind == _AreaKind.DEVICE:
            return torch.full((pages,), _PINNED, dtype=torch.int64)
        bits = self._pagemap.read(start, end)
        codes = torch.full((pages,), _NOT_RESIDENT, dtype=torch.int64)
        n = bits.present.numel()
        present, view = bits.present, codes[:n]
        view[bits.swapped & ~present] = _SWAPPED
        if kind == _AreaKind.LOCKED:
            view[present] = _PINNED
        elif kind == _AreaKind.SHMEM_SHARED:
            view[present] = _SHMEM
        else:
            view[present & bits.file_or_shared] = _FILE_BACKED if kind == _AreaKind.FILE else _SHMEM
            view[present & ~bits.file_or_shared] = _ANONYMOUS
        return codes


def _as_row(residency: Residency) -> list[int]:
    return [getattr(residency, name) for name in CLASSES]


def _classify_from_smaps(vma: Vma, kind: str, start: int, end: int) -> Residency:
    """Per-area estimate from smaps counters, scaled to the part ``[start, end)``."""
    share = (end - start) / vma.size if vma.size else 0.0
    anon = vma.anonymous
    other = max(0, vma.rss - anon)
    absent = max(0, vma.size - vma.rss - vma.swap)
    if kind == _AreaKind.LOCKED:
        full = Residency(pinned=vma.rss, swapped=vma.swap, not_resident=absent)
    elif kind in (_AreaKind.SHMEM_SHARED, _AreaKind.SHMEM_FILE, _AreaKind.ANON):
        full = Residency(anonymous=anon, shmem=other, swapped=vma.swap, not_resident=absent)
    else:
        full = Residency(anonymous=anon, file_backed=other, swapped=vma.swap, not_resident=absent)
    return Residency(*(int(getattr(full, f.name) * share) for f in fields(full)))


def classify_range(start: int, end: int, pid: int | None = None) -> Residency:
    """Classify the bytes ``[start, end)`` of a process (default: this one).

    For many ranges, hold one :class:`RangeClassifier` instead: it reads smaps once.
    """
    with RangeClassifier(pid) as classifier:
        return classifier.classify(start, end)
