"""The residency of a set of processes, a page they share counted once.

Several ranks on one host map the same merged-weight files: each rank's own figures
count those pages again (4 ranks, 4 x 38 GiB file-backed), the host holds them once.
This module adds processes up the way the host does.

``precision`` says how sharing was resolved:

- ``pfn``: every resident page is identified by its page frame number from
  /proc/PID/pagemap and counted once, whichever processes map it (exact). A page
  frame number is only shown to a reader with CAP_SYS_ADMIN; without it the kernel
  reads every PFN as 0, and the set falls back to
- ``pss``: each area's resident bytes are scaled by its Pss / Rss (smaps), the
  kernel's split of a shared page among every process that maps it. A page shared
  only inside the set adds up to one copy; a page shared with a process outside the
  set is counted for its share only, so the figure can be lower than the host's.

The class of a page (anonymous, file-backed, shmem, pinned) comes from the residency
classifier of the process that maps it; a page one process has pinned counts pinned.
Swapped pages are deduplicated by their swap slot; pages the pagemap cannot see
(a GPU driver's mappings) are added as each process reports them.
Counting once costs memory while it runs: a set of about 64 bytes per distinct
resident page (1.6% of what is measured, 600 MiB for 38 GiB of shared weights),
released when the figures are made. Pages are read a GiB at a time and tagged with
byte-wide operations (``bytes.translate`` over every eighth byte), never one call per page.
Whole processes are classified without torch (``hostmem inspect`` stays light);
arbitrary ranges (a component's storages) go through the torch-based range classifier.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from .errors import InputError
from .pagemap import PagemapReader
from .procfs import PAGE_SIZE, ProcReadError, proc_path
from .residency_classes import CLASSES, Residency
from .table import format_table
from .units import format_size

__all__ = ["SetResidency", "aggregate_ranges", "aggregate_processes", "cgroup_pids", "pfns_visible"]

_PFN_MASK = (1 << 55) - 1
_ENTRY = 8
_CHUNK_PAGES = 1 << 18  # 1 GiB of 4 KiB pages per pagemap read
# Tags put in an entry's top byte: the page's class, or why it has none.
_ANON, _FILE, _SHMEM, _PINNED = range(4)
_SWAPPED, _ABSENT = 0xE0, 0xF0
_PRESENT_CLASSES = ("anonymous", "file_backed", "shmem", "pinned")


@dataclass(frozen=True)
class SetResidency:
    """Residency of a set of processes: ``totals`` once per page, ``per_pid`` each alone."""

    pids: tuple[int, ...]
    totals: Residency
    per_pid: Mapping[int, Residency]
    precision: str  # "pfn" or "pss"

    @property
    def summed(self) -> Residency:
        """Each process's figures added up: a shared page once per process that maps it."""
        total = Residency()
        for residency in self.per_pid.values():
            total = total + residency
        return total

    @property
    def shared_bytes(self) -> int:
        """Resident bytes the plain sum counts more than once."""
        return max(0, self.summed.resident - self.totals.resident)

    def to_dict(self) -> dict:
        """JSON-safe, bytes: ``{"pids", "precision", "totals", "summed", "shared_bytes", "processes"}``."""
        return {
            "pids": list(self.pids),
            "precision": self.precision,
            "totals": self.totals.to_dict(),
            "summed": self.summed.to_dict(),
            "shared_bytes": self.shared_bytes,
            "processes": {str(pid): r.to_dict() for pid, r in self.per_pid.items()},
        }

    def to_text(self) -> str:
        t, s = self.totals, self.summed
        lines = [
            f"{len(self.pids)} processes, shared pages counted once: non-reclaimable "
            f"{format_size(t.non_reclaimable)} (anonymous {format_size(t.anonymous)}, shmem "
            f"{format_size(t.shmem)}, pinned {format_size(t.pinned)}), file-backed {format_size(t.file_backed)}",
            f"  each counted alone they add up to non-reclaimable {format_size(s.non_reclaimable)}, file-backed "
            f"{format_size(s.file_backed)}: {format_size(self.shared_bytes)} of pages are shared; "
            f"precision: {self.precision}",
            "",
        ]
        rows = [("pid", "non-recl.", "anonymous", "file-backed", "shmem", "pinned")]
        for pid, r in self.per_pid.items():
            rows.append((pid, *(format_size(v) for v in (r.non_reclaimable, r.anonymous, r.file_backed,
                                                          r.shmem, r.pinned))))
        rows.append(("once", *(format_size(v) for v in (t.non_reclaimable, t.anonymous, t.file_backed,
                                                        t.shmem, t.pinned))))
        return "\n".join(lines + format_table(rows))


def pfns_visible() -> bool:
    """True when this process may read page frame numbers (CAP_SYS_ADMIN).

    Asks for the PFN of a page it has just written: without the capability the
    kernel answers 0 for every page instead of refusing.
    """
    probe = bytearray(PAGE_SIZE * 2)
    probe[PAGE_SIZE] = 1
    address = _buffer_address(probe) + PAGE_SIZE
    with PagemapReader() as reader:
        raw = reader.read_bytes(address, address + 1)
    entry = int.from_bytes(raw[:_ENTRY], "little")
    return bool(entry >> 63) and bool(entry & _PFN_MASK)


def _buffer_address(buffer: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def _tag_table(set_class: int, clear_class: int) -> bytes:
    """Top-byte translation: present pages get a class by pagemap bit 61, others a marker."""
    table = bytearray(256)
    for byte in range(256):
        if byte & 0x80:
            table[byte] = set_class if byte & 0x20 else clear_class
        else:
            table[byte] = _SWAPPED if byte & 0x40 else _ABSENT
    return bytes(table)


_TAG_TABLES = {(s, c): _tag_table(s, c) for s in range(4) for c in range(4)}
_CLEAR_BIT7 = bytes(b & 0x7F for b in range(256))  # drops soft-dirty (bit 55) from byte 6


def _page_classes(residency: Residency) -> tuple[int, int]:
    """The class of a page with pagemap bit 61 set, and of one without, in a range.

    Bit 61 marks a file (or shared) page: in a range the classifier found partly
    anonymous, that splits copied pages from the rest; a range of one class is that
    class throughout (a locked area is pinned whichever bit its pages carry).
    """
    sizes = [residency.anonymous, residency.file_backed, residency.shmem, residency.pinned]
    biggest_other = max((_FILE, _SHMEM, _PINNED), key=lambda c: sizes[c])
    if not sizes[biggest_other]:
        return _ANON, _ANON
    return biggest_other, _ANON if sizes[_ANON] else biggest_other


class _PageSet:
    """Tagged pagemap entries of many processes; equal pages collapse into one key."""

    def __init__(self):
        self.keys: set[int] = set()
        self.unseen = Residency()  # classified resident bytes pagemap shows no page for

    def add_range(self, reader: PagemapReader, start: int, end: int, residency: Residency) -> None:
        if not residency.resident and not residency.swapped:
            return  # a reservation, or never touched: no page to read (and often GiBs of address space)
        tags = _TAG_TABLES[_page_classes(residency)]
        present = 0
        for lo in range(start, end, _CHUNK_PAGES * PAGE_SIZE):
            raw = reader.read_bytes(lo, min(end, lo + _CHUNK_PAGES * PAGE_SIZE))
            top = raw[7::8].translate(tags)
            present += len(top) - top.count(_ABSENT) - top.count(_SWAPPED)
            raw[7::8] = top
            raw[6::8] = raw[6::8].translate(_CLEAR_BIT7)
            self.keys.update(memoryview(raw).cast("Q"))
        if residency.resident and not present:
            self.unseen = self.unseen + Residency(**{c: getattr(residency, c) for c in _PRESENT_CLASSES})

    def residency(self) -> Residency:
        """Bytes per class, each key once; a page pinned anywhere counts pinned only."""
        counts = Counter(map((56).__rrshift__, self.keys))
        pinned = {k & _PFN_MASK for k in self.keys if k >> 56 == _PINNED} if counts[_PINNED] else set()
        for tag in (_ANON, _FILE, _SHMEM):
            counts[tag] -= sum(1 for pfn in pinned if (tag << 56) | pfn in self.keys)
        pages = {name: counts[tag] * PAGE_SIZE for tag, name in enumerate(_PRESENT_CLASSES)}
        return Residency(**pages, swapped=counts[_SWAPPED] * PAGE_SIZE) + self.unseen


def _pss_ratios(pid: int) -> list[tuple[int, int, float]]:
    """``(start, end, Pss / Rss)`` of every area of the process, from smaps."""
    path = proc_path(pid, "smaps")
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError as exc:
        raise ProcReadError(f"{path}: {exc.strerror or exc} (the process may have exited)") from None
    out, area, rss = [], None, 0
    for line in text.splitlines():
        head, _, rest = line.partition(" ")
        if head == "Rss:":
            rss = int(rest.split()[0])
        elif head == "Pss:" and area is not None:
            out.append((*area, int(rest.split()[0]) / rss if rss else 0.0))
        elif "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            area, rss = (start, end), 0
    return out


def _scaled(residency: Residency, ratio: float) -> Residency:
    keep = {c: getattr(residency, c) for c in ("not_resident",)}
    scaled = {c: int(getattr(residency, c) * ratio) for c in CLASSES if c != "not_resident"}
    return Residency(**scaled, **keep, pinned_anonymous=int(residency.pinned_anonymous * ratio))


def _pss_share(ratios: list[tuple[int, int, float]], start: int) -> float:
    """Pss / Rss of the area holding ``start`` (1.0 where smaps has no such area)."""
    i = bisect.bisect_right(ratios, (start, float("inf"))) - 1
    return ratios[i][2] if i >= 0 and ratios[i][0] <= start < ratios[i][1] else 1.0


def aggregate_ranges(ranges_by_pid: Mapping[int, Sequence[tuple[int, int]]], *,
                     pfns: bool | None = None) -> SetResidency:
    """The residency of address ranges of several processes, a shared page counted once.

    ``ranges_by_pid`` maps a pid to ``[(start, end), ...]`` of that process (the
    storages of a component, say). ``pfns=None`` uses page frame numbers where this
    process may read them (``pfn``), else Pss (``pss``); see the module.
    """
    from .residency import RangeClassifier  # torch: per-range classification needs it

    classified = {}
    for pid, ranges in ranges_by_pid.items():
        ranges = [(s, e) for s, e in ranges if e > s]
        with RangeClassifier(pid) as classifier:
            classified[pid] = [(s, e, r) for (s, e), r in zip(ranges, classifier.classify_many(ranges))]
    return _aggregate(classified, pfns_visible() if pfns is None else pfns)


def aggregate_processes(pids: Iterable[int], *, pfns: bool | None = None) -> SetResidency:
    """Every mapping of every process in ``pids``, a page shared between them counted once.

    Whole mappings are classified without torch (``hostmem inspect`` stays light).
    """
    from .process import inspect_process

    unique = list(dict.fromkeys(int(p) for p in pids))
    if not unique:
        raise InputError("no process to aggregate: give at least one pid")
    classified = {}
    for pid in unique:
        classified[pid] = [(m.start, m.end, m.residency) for m in inspect_process(pid).mappings]
    return _aggregate(classified, pfns_visible() if pfns is None else pfns)


def _aggregate(classified: Mapping[int, list[tuple[int, int, Residency]]], use_pfns: bool) -> SetResidency:
    """Add classified ranges up per pid, and once per page (``pfn``) or by Pss (``pss``)."""
    per_pid = {pid: sum((r for _, _, r in items), Residency()) for pid, items in classified.items()}
    if use_pfns:
        pages = _PageSet()
        for pid, items in classified.items():
            _add_pages(pages, pid, items)
        summed = sum(per_pid.values(), Residency())
        totals = pages.residency() + Residency(not_resident=summed.not_resident)
    else:
        totals = Residency()
        for pid, items in classified.items():
            ratios = _pss_ratios(pid)
            for start, end, r in items:
                totals = totals + _scaled(r, _pss_share(ratios, start))
    return SetResidency(tuple(per_pid), totals, per_pid, "pfn" if use_pfns else "pss")


def _add_pages(pages: _PageSet, pid: int, items) -> None:
    with PagemapReader(pid) as reader:
        for start, end, residency in items:
            pages.add_range(reader, start, end, residency)


def cgroup_pids(path: str | os.PathLike) -> list[int]:
    """The pids of a cgroup folder (``cgroup.procs``: the same file in v1 and v2)."""
    folder = os.fspath(path)
    procs = os.path.join(folder, "cgroup.procs")
    if not os.path.isdir(folder):
        raise ProcReadError(f"{folder}: no such cgroup folder (give a folder under /sys/fs/cgroup)")
    try:
        with open(procs, encoding="ascii") as handle:
            return [int(line) for line in handle.read().split()]
    except FileNotFoundError:
        raise ProcReadError(f"{folder}: no cgroup.procs (not a cgroup folder)") from None
    except (OSError, ValueError) as exc:
        raise ProcReadError(f"{procs}: {getattr(exc, 'strerror', None) or exc}") from None
