"""A process's memory areas and how each one's pages are classified, without torch.

:class:`AreaSnapshot` reads a process's areas (maps or smaps), its mounts and its
pagemap once, and says per area how a page of it is classified (:meth:`area_kind`).
It classifies whole areas itself (:meth:`AreaSnapshot.classify_whole_area`): one
pagemap read per area (a page-table scan for a shared file mapping) and a byte histogram
in C, which is all ``hostmem inspect`` needs, so that command never imports torch.
:class:`hostmem.residency.RangeClassifier` builds on it for arbitrary ranges (page codes
counted per range, also without torch).
"""

from __future__ import annotations

from dataclasses import fields

from .pagemap import SCAN_PFNZERO, SCAN_PRESENT, SCAN_SWAPPED, PagemapReader
from .procfs.maps import strip_deleted
from .procfs.mounts import SHMEM_NAMES as _SHMEM_NAMES
from .procfs import PAGE_SIZE, Mount, ProcReadError, Vma, is_shmem_fs, read_maps, read_mounts, read_smaps, read_status
from .residency_classes import CLASSES, Residency

__all__ = ["AreaKind", "AreaSnapshot", "CODE_TABLES", "CODES", "UNIFORM_CODE", "residency_of_counts"]

ANONYMOUS, FILE_BACKED, SHMEM, PINNED, SWAPPED, NOT_RESIDENT = range(len(CLASSES))
# A page's code: the six CLASSES, plus pinned pages of anonymous memory (still RssAnon).
PINNED_ANON = len(CLASSES)
CODES = len(CLASSES) + 1

_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/dri/", "/dev/kfd")
CHUNK_PAGES = 1 << 18  # 1 GiB of 4 KiB pages per pagemap read: bounded memory per chunk


class AreaKind:
    DEVICE = "device"
    LOCKED = "locked"
    SHMEM_SHARED = "shmem_shared"  # every present page is shmem
    FILE = "file"  # present pages: file bit -> file_backed, else anonymous
    # MAP_SHARED file on a page-cache filesystem: a present page can only be a page of the
    # file (no copy-on-write), so present/swapped alone decide and a scan can read them.
    FILE_SHARED = "file_shared"
    SHMEM_FILE = "shmem_file"  # private tmpfs mapping: file bit -> shmem, else anonymous
    ANON = "anon"  # present pages: shared bit -> shmem, else anonymous
    NO_ACCESS = "no_access"  # ---p: nothing can be resident


def _code_table(present_file: int, present_other: int) -> tuple[int, ...]:
    """Codes for the 8 values of pagemap bits 63..61 (present, swapped, file-or-shared)."""
    table = []
    for bits in range(8):
        present, swapped, file_page = bits & 4, bits & 2, bits & 1
        if present:
            table.append(present_file if file_page else present_other)
        else:
            table.append(SWAPPED if swapped else NOT_RESIDENT)
    return tuple(table)


CODE_TABLES = {
    AreaKind.LOCKED: _code_table(PINNED, PINNED_ANON),
    AreaKind.SHMEM_SHARED: _code_table(SHMEM, SHMEM),
    AreaKind.FILE: _code_table(FILE_BACKED, ANONYMOUS),
    AreaKind.FILE_SHARED: _code_table(FILE_BACKED, ANONYMOUS),
    AreaKind.SHMEM_FILE: _code_table(SHMEM, ANONYMOUS),
    AreaKind.ANON: _code_table(SHMEM, ANONYMOUS),
}
# Areas classified without pagemap: driver memory is pinned whole; an area with no
# access rights (a reservation, a guard region) cannot be touched, so nothing is resident.
UNIFORM_CODE = {AreaKind.DEVICE: PINNED, AreaKind.NO_ACCESS: NOT_RESIDENT}
# Page codes per area kind, per top byte of a pagemap entry (bits 63..56; 63..61 pick the code).
_BYTE_TABLES = {kind: bytes(table[(byte >> 5) & 7] for byte in range(256)) for kind, table in CODE_TABLES.items()}
# Paths whose shared mappings may be driver memory (VM_PFNMAP/VM_MIXEDMAP), never a scan.
_PSEUDO_PREFIXES = ("/dev/", "/proc/", "/sys/")


def residency_of_counts(row: list[int]) -> Residency:
    """A :class:`Residency` from bytes per code (``CODES`` entries)."""
    return Residency(
        anonymous=row[ANONYMOUS],
        file_backed=row[FILE_BACKED],
        shmem=row[SHMEM],
        pinned=row[PINNED] + row[PINNED_ANON],
        swapped=row[SWAPPED],
        not_resident=row[NOT_RESIDENT],
        pinned_anonymous=row[PINNED_ANON],
    )


def classify_from_smaps(vma: Vma, kind: str, start: int, end: int) -> Residency:
    """Per-area figures from smaps counters, scaled to the part ``[start, end)``."""
    share = (end - start) / vma.size if vma.size else 0.0
    anon = vma.anonymous
    other = max(0, vma.rss - anon)
    absent = max(0, vma.size - vma.rss - vma.swap)
    if kind == AreaKind.LOCKED:
        full = Residency(pinned=vma.rss, swapped=vma.swap, not_resident=absent)
    elif kind in (AreaKind.SHMEM_SHARED, AreaKind.SHMEM_FILE, AreaKind.ANON):
        full = Residency(anonymous=anon, shmem=other, swapped=vma.swap, not_resident=absent)
    else:
        full = Residency(anonymous=anon, file_backed=other, swapped=vma.swap, not_resident=absent)
    return Residency(*(int(getattr(full, f.name) * share) for f in fields(full)))


class AreaSnapshot:
    """A snapshot of one process's memory areas; use as a context manager, or call :meth:`close`.

    Reads mountinfo once and keeps pagemap open. Take a new one after the process
    maps or locks more memory.
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

    def close(self) -> None:
        if self._pagemap is not None:
            self._pagemap.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_shmem_fs(self, path: str) -> bool:
        cached = self._fs_cache.get(path)
        if cached is None:
            cached = self._fs_cache[path] = is_shmem_fs(strip_deleted(path), self._mounts)
        return cached

    def area_kind(self, vma: Vma) -> str:
        """Return how pages of ``vma`` are classified (one of :class:`AreaKind`)."""
        path = vma.path or ""
        if path.startswith(_DEVICE_PREFIXES):
            return AreaKind.DEVICE
        if vma.perms.startswith("---"):
            return AreaKind.NO_ACCESS
        if vma.is_locked:
            return AreaKind.LOCKED
        if path.startswith(_SHMEM_NAMES):
            if vma.is_shared:
                return AreaKind.SHMEM_SHARED
            # private: /dev/zero's is anonymous memory; a memfd's, as a private tmpfs file's, its
            # pages are the file's until a write copies them
            return AreaKind.ANON if path.startswith("/dev/zero") else AreaKind.SHMEM_FILE
        if vma.is_file and path.startswith("/"):
            if self._on_shmem_fs(path):
                return AreaKind.SHMEM_SHARED if vma.is_shared else AreaKind.SHMEM_FILE
            if vma.is_shared and not path.startswith(_PSEUDO_PREFIXES):
                return AreaKind.FILE_SHARED
            return AreaKind.FILE
        return AreaKind.ANON

    def classify_whole_area(self, vma: Vma) -> Residency:
        """The residency of a whole area: its pages' codes counted in C, no torch.

        A whole area needs no prefix sums: the count of pages per code says everything,
        and ``bytes.count`` gives it at memory speed.
        """
        kind = self.area_kind(vma)
        row = [0] * CODES
        uniform = UNIFORM_CODE.get(kind)
        if uniform is not None:
            row[uniform] = vma.size
            return residency_of_counts(row)
        if self._pagemap is None:
            return classify_from_smaps(vma, kind, vma.start, vma.end)
        chunk = CHUNK_PAGES * PAGE_SIZE
        for lo in range(vma.start, vma.end, chunk):
            codes = self.page_codes(kind, lo, min(vma.end, lo + chunk))
            for code in range(CODES):
                row[code] += codes.count(code) * PAGE_SIZE
        return residency_of_counts(row)

    def page_codes(self, kind: str, start: int, end: int) -> bytes:
        """One class code per page of ``[start, end)`` of an area of ``kind``, as bytes.

        A shared file area is scanned (present and swapped runs, no ``struct page`` per
        page) where the kernel can; the gaps between runs, and every other kind, come
        from pagemap's entries, so an area the scan skips still reads as pagemap has it.
        Pages pagemap has no entry for are not resident.
        """
        if kind == AreaKind.FILE_SHARED:
            runs = self._pagemap.scan(start, end)
            if runs is not None:
                return self._codes_of_runs(kind, runs, start, end)
        return self._entry_codes(kind, start, end)

    def _entry_codes(self, kind: str, start: int, end: int) -> bytes:
        """Codes from pagemap's entries: the top byte of each little-endian 8-byte entry
        looked up in the kind's table (C-speed slicing and translation).

        In anonymous memory, a page only ever read maps the shared zero page (4 KiB, or the
        huge zero page, which pagemap even marks as shared): present in pagemap, charged to
        no one (neither RssAnon nor smaps' Anonymous count it). The kernel's scan names
        those pages (``PAGE_IS_PFNZERO``, Linux 6.7+), and they count as not resident."""
        pages = (end - start + PAGE_SIZE - 1) // PAGE_SIZE
        codes = bytes(self._pagemap.read_bytes(start, end)[7::8]).translate(_BYTE_TABLES[kind])
        codes += bytes([NOT_RESIDENT]) * (pages - len(codes))
        if kind == AreaKind.ANON and (ANONYMOUS in codes or SHMEM in codes):
            codes = self._without_zero_pages(codes, start, end)
        return codes

    def _without_zero_pages(self, codes: bytes, start: int, end: int) -> bytes:
        runs = self._pagemap.scan(start, end, SCAN_PFNZERO)
        if not runs:  # none, or a kernel without the scan: pagemap alone cannot tell them apart
            return codes
        base, out = start // PAGE_SIZE * PAGE_SIZE, bytearray(codes)
        for lo, hi, _ in runs:
            first, last = (max(lo, base) - base) // PAGE_SIZE, (min(hi, end) - base + PAGE_SIZE - 1) // PAGE_SIZE
            out[first:last] = bytes([NOT_RESIDENT]) * (last - first)
        return bytes(out)

    def _codes_of_runs(self, kind: str, runs: list[tuple[int, int, int]], start: int, end: int) -> bytes:
        """Codes for ``[start, end)`` from scan runs: present -> file_backed, swapped ->
        swapped; each gap between runs is read from pagemap."""
        base = start // PAGE_SIZE * PAGE_SIZE
        pages = (end - base + PAGE_SIZE - 1) // PAGE_SIZE
        if len(runs) == 1 and runs[0][0] <= base and runs[0][1] >= base + pages * PAGE_SIZE:
            return bytes([_RUN_CODE[runs[0][2]]]) * pages  # the usual case: all resident
        codes = bytearray(pages)
        at = base
        for lo, hi, categories in runs + [(base + pages * PAGE_SIZE, 0, 0)]:
            if lo > at:
                gap = self._entry_codes(kind, at, lo)
                codes[(at - base) // PAGE_SIZE : (lo - base) // PAGE_SIZE] = gap
            if categories:
                first, last = (lo - base) // PAGE_SIZE, (hi - base) // PAGE_SIZE
                codes[first:last] = bytes([_RUN_CODE[categories]]) * (last - first)
            at = max(at, hi)
        return bytes(codes)


_RUN_CODE = {SCAN_PRESENT: FILE_BACKED, SCAN_SWAPPED: SWAPPED}
