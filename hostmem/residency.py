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
from dataclasses import asdict, dataclass, fields

import torch

from .pagemap import PagemapReader
from .procfs import PAGE_SIZE, Mount, ProcReadError, Vma, filesystem_of, read_mounts, read_smaps

__all__ = ["Residency", "RangeClassifier", "classify_range", "CLASSES"]

CLASSES = ("anonymous", "file_backed", "shmem", "pinned", "swapped", "not_resident")

_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd")
_SHMEM_FS = {"tmpfs", "devtmpfs", "hugetlbfs", "ramfs", "shm"}
_SHMEM_NAMES = ("/SYSV", "/memfd:", "/dev/zero", "[anon_shmem")


@dataclass(frozen=True)
class Residency:
    """Bytes of one range (or a sum of ranges) per residency class."""

    anonymous: int = 0
    file_backed: int = 0
    shmem: int = 0
    pinned: int = 0
    swapped: int = 0
    not_resident: int = 0

    def __add__(self, other: "Residency") -> "Residency":
        return Residency(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def non_reclaimable(self) -> int:
        """Anonymous + shmem + pinned: what the kernel cannot drop without swap."""
        return self.anonymous + self.shmem + self.pinned

    @property
    def resident(self) -> int:
        return self.anonymous + self.file_backed + self.shmem + self.pinned

    @property
    def total(self) -> int:
        return self.resident + self.swapped + self.not_resident

    def to_dict(self) -> dict[str, int]:
        """JSON-safe dict in bytes, with ``non_reclaimable`` added."""
        out = asdict(self)
        out["non_reclaimable"] = self.non_reclaimable
        return out


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
        self.vmas: list[Vma] = read_smaps(pid)
        self._starts = [v.start for v in self.vmas]
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
            mount = filesystem_of(_strip_deleted(path), self._mounts)
            cached = mount is not None and mount.fs_type in _SHMEM_FS
            self._fs_cache[path] = cached
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

    def overlapping(self, start: int, end: int) -> list[Vma]:
        """Return the areas that overlap ``[start, end)``."""
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        out = []
        while i < len(self.vmas) and self.vmas[i].start < end:
            if self.vmas[i].end > start:
                out.append(self.vmas[i])
            i += 1
        return out

    def classify(self, start: int, end: int) -> Residency:
        """Return the residency of the bytes ``[start, end)``; unmapped bytes are skipped."""
        total = Residency()
        for vma in self.overlapping(start, end):
            total = total + self._classify_in(vma, max(start, vma.start), min(end, vma.end))
        return total

    def classify_area(self, vma: Vma) -> Residency:
        """Return the residency of a whole area."""
        return self._classify_in(vma, vma.start, vma.end)

    def _classify_in(self, vma: Vma, start: int, end: int) -> Residency:
        kind = self.area_kind(vma)
        if kind == _AreaKind.DEVICE:
            return Residency(pinned=end - start)
        if self._pagemap is None:
            return _classify_from_smaps(vma, kind, start, end)
        bits = self._pagemap.read(start, end)
        weights = _byte_weights(start, end, bits.present.numel())
        present = bits.present
        swapped = bits.swapped & ~present
        absent = ~(present | swapped)

        def total(mask: torch.Tensor) -> int:
            return int(weights[mask].sum())

        if kind == _AreaKind.LOCKED:
            return Residency(pinned=total(present), swapped=total(swapped), not_resident=total(absent))
        if kind == _AreaKind.SHMEM_SHARED:
            return Residency(shmem=total(present), swapped=total(swapped), not_resident=total(absent))
        file_pages = present & bits.file_or_shared
        anon_pages = present & ~bits.file_or_shared
        paged = {
            _AreaKind.FILE: "file_backed",
            _AreaKind.SHMEM_FILE: "shmem",
            _AreaKind.ANON: "shmem",
        }[kind]
        return Residency(
            anonymous=total(anon_pages),
            swapped=total(swapped),
            not_resident=total(absent),
            **{paged: total(file_pages)},
        )


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


def _byte_weights(start: int, end: int, count: int) -> torch.Tensor:
    """Bytes of ``[start, end)`` that fall in each of its ``count`` pages."""
    weights = torch.full((count,), PAGE_SIZE, dtype=torch.int64)
    if count == 0:
        return weights
    weights[0] -= start % PAGE_SIZE
    tail = (-end) % PAGE_SIZE
    weights[-1] -= tail
    return weights


def classify_range(start: int, end: int, pid: int | None = None) -> Residency:
    """Classify the bytes ``[start, end)`` of a process (default: this one).

    For many ranges, hold one :class:`RangeClassifier` instead: it reads smaps once.
    """
    with RangeClassifier(pid) as classifier:
        return classifier.classify(start, end)
