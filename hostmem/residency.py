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
- ``not_resident``: mapped but not faulted in, or only read where nothing was written
  (the shared zero page): costs nothing now.

The class is decided per page from pagemap bits, not per area: a private file mapping
whose pages were partly written shows exactly those pages as anonymous. Byte counts are
exact for ranges that do not start or end on a page boundary: a page shared by two
tensors is split between them by the bytes each one covers.
"""

from __future__ import annotations

import bisect

from .areas import CHUNK_PAGES, CODES, UNIFORM_CODE, AreaKind, AreaSnapshot, classify_from_smaps, residency_of_counts
from .procfs import PAGE_SIZE, Vma
from .residency_classes import CLASSES, Residency

__all__ = ["Residency", "RangeClassifier", "classify_range", "CLASSES"]


class RangeClassifier(AreaSnapshot):
    """A snapshot of one process's memory areas that classifies address ranges.

    Reads smaps and mountinfo once, keeps pagemap open, and answers many
    :meth:`classify` calls cheaply. Take a new one after the process maps or locks
    more memory. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, pid: int | None = None):
        super().__init__(pid)
        self._starts = [v.start for v in self.vmas]
        self._ends = [v.end for v in self.vmas]

    def __enter__(self) -> "RangeClassifier":
        return self

    def classify(self, start: int, end: int) -> Residency:
        """Return the residency of the bytes ``[start, end)``; unmapped bytes are skipped."""
        return self.classify_many([(start, end)])[0]

    def classify_area(self, vma: Vma) -> Residency:
        """Return the residency of a whole area."""
        return self.classify_many([(vma.start, vma.end)])[0]

    def classify_many(self, ranges: list[tuple[int, int]]) -> list[Residency]:
        """Classify many ranges at once: one pagemap read per area, byte counts per range.

        This is what keeps accounting a 2,000-parameter model in milliseconds: the cost
        is one pass over the pages (slicing and counting bytes in C) plus a few list
        operations per range, with no tensor built per range or per area. Ranges with the
        same figures share one :class:`Residency` (it is immutable).
        """
        rows = [[0] * _CODES for _ in ranges]
        for area, items in self._pieces(ranges).items():
            vma = self.vmas[area]
            kind = self.area_kind(vma)
            if self._pagemap is None and kind != AreaKind.DEVICE:
                for index, start, end in items:
                    for code, count in enumerate(_as_row(classify_from_smaps(vma, kind, start, end))):
                        rows[index][code] += count
                continue
            self._count_pieces(kind, items, rows)
        shared: dict[tuple[int, ...], Residency] = {}
        out = []
        for row in rows:
            key = tuple(row)
            found = shared.get(key)
            if found is None:
                found = shared[key] = residency_of_counts(row)
            out.append(found)
        return out

    def _pieces(self, ranges: list[tuple[int, int]]) -> dict[int, list[tuple[int, int, int]]]:
        """Area index -> ``(range index, start, end)`` of each part of a range inside it."""
        starts, ends, count = self._starts, self._ends, len(self._starts)
        pieces: dict[int, list[tuple[int, int, int]]] = {}
        for index, (start, end) in enumerate(ranges):
            i = bisect.bisect_right(starts, start) - 1
            if i >= 0 and start < end <= ends[i]:  # inside one area: the usual case
                found = pieces.get(i)
                if found is None:
                    found = pieces[i] = []
                found.append((index, start, end))
                continue
            i = max(0, i)
            while i < count and starts[i] < end:
                if ends[i] > start:
                    pieces.setdefault(i, []).append((index, max(start, starts[i]), min(end, ends[i])))
                i += 1
        return pieces

    def _count_pieces(self, kind: str, items: list[tuple[int, int, int]], rows: list[list[int]]) -> None:
        """Add each piece's bytes per code to its row: whole areas at once, pages in bounded chunks."""
        uniform = _UNIFORM_CODE.get(kind)
        if uniform is not None:
            for index, start, end in items:
                rows[index][uniform] += end - start
            return
        base = min(s for _, s, _ in items) // PAGE_SIZE * PAGE_SIZE
        top = max(e for _, _, e in items)
        chunk = _CHUNK_PAGES * PAGE_SIZE
        for lo in range(base, top, chunk):
            hi = min(top, lo + chunk)
            inside = [(index, max(s, lo), min(e, hi)) for index, s, e in items if s < hi and e > lo]
            if inside:
                _count_chunk(self.page_codes(kind, lo, hi), lo, inside, rows)


def _count_chunk(codes: bytes, lo: int, pieces: list[tuple[int, int, int]], rows: list[list[int]]) -> None:
    """Add the bytes per code of each piece of the chunk starting at ``lo`` to its row.

    Where every page of the chunk has one code (a model's weights, all resident and
    file-backed, say), each piece is wholly that class: its bytes are its length. Else a
    piece whose own pages share one code is that class; only a mixed piece is counted
    per code, its partial first and last pages taking off the bytes outside it.
    """
    if codes.count(codes[0]) == len(codes):
        code = codes[0]
        for index, start, end in pieces:
            rows[index][code] += end - start
        return
    for index, start, end in pieces:
        if end <= start:
            continue
        first, stop = (start - lo) // PAGE_SIZE, (end - lo + PAGE_SIZE - 1) // PAGE_SIZE
        own = codes[first:stop]
        row = rows[index]
        if own.count(own[0]) == len(own):
            row[own[0]] += end - start
            continue
        for code in set(own):
            row[code] += own.count(code) * PAGE_SIZE
        row[own[0]] -= start - lo - first * PAGE_SIZE
        row[own[-1]] -= stop * PAGE_SIZE - (end - lo)


_CODES = CODES
_UNIFORM_CODE = UNIFORM_CODE
_CHUNK_PAGES = CHUNK_PAGES


def _as_row(residency: Residency) -> list[int]:
    row = [getattr(residency, name) for name in CLASSES] + [residency.pinned_anonymous]
    row[CLASSES.index("pinned")] -= residency.pinned_anonymous
    return row


def classify_range(start: int, end: int, pid: int | None = None) -> Residency:
    """Classify the bytes ``[start, end)`` of a process (default: this one).

    For many ranges, hold one :class:`RangeClassifier` instead: it reads smaps once.
    """
    with RangeClassifier(pid) as classifier:
        return classifier.classify(start, end)
