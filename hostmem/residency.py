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

import torch

from .areas import CHUNK_PAGES, CODE_TABLES, CODES, UNIFORM_CODE, AreaKind, AreaSnapshot, classify_from_smaps, residency_of_counts
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

    def __enter__(self) -> "RangeClassifier":
        return self

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
            if self._pagemap is None and kind != AreaKind.DEVICE:
                for index, start, end in items:
                    out[index] += torch.tensor(_as_row(classify_from_smaps(vma, kind, start, end)))
                continue
            index, sums = self._sum_pieces(vma, kind, items)
            out.index_add_(0, index, sums)
        return [residency_of_counts(row) for row in out.tolist()]

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
        """Prefix sums of the page codes of ``[lo, hi)``, read off at each piece's ends.

        Where every page of the chunk has the same pagemap bits (a model's weights, all
        resident and file-backed, say) each piece is wholly that one class: its bytes
        are its length, with no lookup, count or prefix sum over the pages.
        """
        code_bytes = _code_bytes(kind, self._pagemap.read_bytes(lo, hi))
        # Offsets from the chunk's first page: kernel addresses do not fit an int64.
        starts = torch.tensor([s - lo for _, s, _ in pieces], dtype=torch.int64)
        ends = torch.tensor([e - lo for _, _, e in pieces], dtype=torch.int64)
        pages = (hi - lo + PAGE_SIZE - 1) // PAGE_SIZE
        if len(code_bytes) == pages and code_bytes.count(code_bytes[:1]) == pages:  # one class throughout
            sums = torch.zeros(len(pieces), _CODES, dtype=torch.int64)
            sums[:, code_bytes[0]] = ends - starts
            return sums
        codes = self._page_codes(kind, lo, hi, code_bytes)
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

    def _page_codes(self, kind: str, start: int, end: int, code_bytes: bytes | None = None) -> torch.Tensor:
        """One code per page of ``[start, end)`` (pages pagemap has no entry for: not
        resident); ``code_bytes`` as :func:`_code_bytes` gives them, read here when not given."""
        pages = (end - start + PAGE_SIZE - 1) // PAGE_SIZE
        if code_bytes is None:
            code_bytes = _code_bytes(kind, self._pagemap.read_bytes(start, end))
        codes = torch.full((pages,), CLASSES.index("not_resident"), dtype=torch.int64)
        if code_bytes:
            codes[: len(code_bytes)] = torch.frombuffer(bytearray(code_bytes), dtype=torch.uint8)
        return codes


# Page codes per area kind, per top byte of a pagemap entry (bits 63..61 are its bits 7..5).
_BYTE_TABLES = {kind: bytes(table[(byte >> 5) & 7] for byte in range(256)) for kind, table in CODE_TABLES.items()}
_CODES = CODES
_UNIFORM_CODE = UNIFORM_CODE
_CHUNK_PAGES = CHUNK_PAGES


def _code_bytes(kind: str, entries: bytearray) -> bytes:
    """One class code per page, as bytes: the top byte of each little-endian 8-byte pagemap
    entry (bits 63..56) looked up in the kind's table. C-speed slicing and translation, no
    tensor operation: on a busy host each of those can wait on a descheduled thread."""
    return bytes(entries[7::8]).translate(_BYTE_TABLES[kind])


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
