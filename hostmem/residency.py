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
    NO_ACCESS = "no_access"  # ---p: nothing can be resident


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
        if vma.perms.startswith("---"):
            return _AreaKind.NO_ACCESS
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
        out = torch.zeros(len(ranges), _CODES, dtype=torch.int64)
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
        return [_from_row(row) for row in out.tolist()]

    def _overlapping_indices(self, start: int, end: int) -> list[int]:
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        found = []
        while i < len(self.vmas) and self.vmas[i].start < end:
            if self.vmas[i].end > start:
                found.append(i)
            i += 1
        return found

    def _sum_pieces(self, vma: Vma, kind: str, items: list[tuple[int, int, int]]):
        """Bytes per code of each piece: whole areas at once, pages in bounded chunks."""
        index = torch.tensor([i for i, _, _ in items], dtype=torch.int64)
        uniform = _UNIFORM_CODE.get(kind)
        if uniform is not None:
            sums = torch.zeros(len(items), _CODES, dtype=torch.int64)
            sums[:, uniform] = torch.tensor([e - s for _, s, e in items], dtype=torch.int64)
            return index, sums
        base = min(s for _, s, _ in items) // PAGE_SIZE * PAGE_SIZE
        top = max(e for _, _, e in items)
        sums = torch.zeros(len(items), _CODES, dtype=torch.int64)
        chunk = _CHUNK_PAGES * PAGE_SIZE
        for lo in range(base, top, chunk):
            hi = min(top, lo + chunk)
            inside = [(row, max(s, lo), min(e, hi)) for row, (_, s, e) in enumerate(items) if s < hi and e > lo]
            if inside:
                rows = torch.tensor([r for r, _, _ in inside], dtype=torch.int64)
                sums.index_add_(0, rows, self._sum_chunk(kind, lo, hi, inside))
        return index, sums

    def _sum_chunk(self, kind: str, lo: int, hi: int, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
        """Prefix sums of the page codes of ``[lo, hi)``, read off at each piece's ends."""
        codes = self._page_codes(kind, lo, hi)
        # Offsets from the chunk's first page: kernel addresses do not fit an int64.
        starts = torch.tensor([s - lo for _, s, _ in pieces], dtype=torch.int64)
        ends = torch.tensor([e - lo for _, _, e in pieces], dtype=torch.int64)
        first = starts // PAGE_SIZE
        stop = (ends + PAGE_SIZE - 1) // PAGE_SIZE
        sums = torch.zeros(len(pieces), _CODES, dtype=torch.int64)
        present = torch.bincount(codes, minlength=_CODES).nonzero().flatten().tolist()
        for code in present:  # usually one or two codes per area
            cumulative = torch.zeros(codes.numel() + 1, dtype=torch.int64)
            torch.cumsum(codes == code, 0, out=cumulative[1:])
            sums[:, code] = (cumulative[stop] - cumulative[first]) * PAGE_SIZE
        rows = torch.arange(len(pieces))
        # Partial first and last pages: take off the bytes outside the piece.
        sums[rows, codes[first]] -= starts - first * PAGE_SIZE
        sums[rows, codes[stop - 1]] -= stop * PAGE_SIZE - ends
        return sums

    def _page_codes(self, kind: str, start: int, end: int) -> torch.Tensor:
        """One code per page of ``[start, end)``: pagemap bits 63..61 looked up per kind."""
        pages = (end - start + PAGE_SIZE - 1) // PAGE_SIZE
        raw = self._pagemap.read_raw(start, end)
        codes = torch.full((pages,), _NOT_RESIDENT, dtype=torch.int64)
        codes[: raw.numel()] = _CODE_TABLES[kind][(raw >> 61) & 7]
        return codes


def _code_table(present_file: int, present_other: int) -> torch.Tensor:
    """Codes for the 8 values of pagemap bits (present, swapped, file-or-shared)."""
    table = []
    for bits in range(8):
        present, swapped, file_page = bits & 4, bits & 2, bits & 1
        if present:
            table.append(present_file if file_page else present_other)
        else:
            table.append(_SWAPPED if swapped else _NOT_RESIDENT)
    return torch.tensor(table, dtype=torch.int64)


# A page's code: the six CLASSES, plus pinned pages of anonymous memory (still RssAnon).
_PINNED_ANON = len(CLASSES)
_CODES = len(CLASSES) + 1
_CHUNK_PAGES = 1 << 18  # 1 GiB of 4 KiB pages per pagemap read: bounded memory per chunk
_CODE_TABLES = {
    _AreaKind.LOCKED: _code_table(_PINNED, _PINNED_ANON),
    _AreaKind.SHMEM_SHARED: _code_table(_SHMEM, _SHMEM),
    _AreaKind.FILE: _code_table(_FILE_BACKED, _ANONYMOUS),
    _AreaKind.SHMEM_FILE: _code_table(_SHMEM, _ANONYMOUS),
    _AreaKind.ANON: _code_table(_SHMEM, _ANONYMOUS),
}
# Areas classified without pagemap: driver memory is pinned whole; an area with no
# access rights (a reservation, a guard region) cannot be touched, so nothing is resident.
_UNIFORM_CODE = {_AreaKind.DEVICE: _PINNED, _AreaKind.NO_ACCESS: _NOT_RESIDENT}


def _from_row(row: list[int]) -> Residency:
    return Residency(
        anonymous=row[_ANONYMOUS],
        file_backed=row[_FILE_BACKED],
        shmem=row[_SHMEM],
        pinned=row[_PINNED] + row[_PINNED_ANON],
        swapped=row[_SWAPPED],
        not_resident=row[_NOT_RESIDENT],
        pinned_anonymous=row[_PINNED_ANON],
    )


def _as_row(residency: Residency) -> list[int]:
    row = [getattr(residency, name) for name in CLASSES] + [residency.pinned_anonymous]
    row[_PINNED] -= residency.pinned_anonymous
    return row


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
