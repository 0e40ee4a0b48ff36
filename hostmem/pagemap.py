"""/proc/PID/pagemap: one 64-bit entry per virtual page, read in batches.

The bits used here (Documentation/admin-guide/mm/pagemap.rst):

- 63: page present in RAM
- 62: page swapped
- 61: page is a file page or shared anonymous (clear for a private copy-on-write page)
- 56: page exclusively mapped

A range is read with one ``pread`` into raw bytes; the classifiers (``residency``,
``areas``, ``host_aggregate``) decode whole batches of them at once, never one
``struct`` call per page.

Where only "present" and "swapped" matter, :meth:`PagemapReader.scan` asks the kernel's
``PAGEMAP_SCAN`` ioctl (Linux 6.7+) for runs of such pages instead. Building an 8-byte
entry makes the kernel look up every present page's ``struct page`` (file or anonymous,
mapped once or more): on a resident multi-GiB model those cache misses are most of the
accountant's time. Asked for present/swapped only, the scan reads the page table alone.
"""

from __future__ import annotations

import fcntl
import os
import struct
from array import array

from .procfs import PAGE_SIZE, ProcReadError, proc_path

__all__ = ["PagemapReader", "SCAN_PRESENT", "SCAN_SWAPPED", "SCAN_PFNZERO"]

_ENTRY = 8
# linux/fs.h: struct pm_scan_arg (12 x u64), struct page_region (start, end, categories),
# PAGEMAP_SCAN = _IOWR('f', 16, struct pm_scan_arg), and the categories asked for here.
_SCAN_ARG = struct.Struct("=12Q")
_PAGEMAP_SCAN = (3 << 30) | (_SCAN_ARG.size << 16) | (ord("f") << 8) | 16
SCAN_PRESENT = 1 << 3
SCAN_SWAPPED = 1 << 4
SCAN_PFNZERO = 1 << 5  # the shared zero page (4 KiB or huge): what a read of never-written memory maps
# Per top byte of an entry (bits 63..56): 1 where the page is present and not a file
# page (bit 63 set, 61 clear), or swapped (bit 62).
_PRIVATE_COPY = bytes(int((byte & 0xA0) == 0x80 or bool(byte & 0x40)) for byte in range(256))
_SCAN_REGIONS = 512  # runs returned per ioctl; the walk resumes where a full batch stopped


class PagemapReader:
    """An open /proc/PID/pagemap; use as a context manager or call :meth:`close`."""

    def __init__(self, pid: int | None = None):
        self.path = proc_path(pid, "pagemap")
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ProcReadError(f"{self.path}: not found (the process may have exited)") from None
        except PermissionError:
            raise ProcReadError(
                f"{self.path}: permission denied (reading another user's pagemap needs root "
                "or CAP_SYS_ADMIN)"
            ) from None
        self._scan_supported = True

    def read_bytes(self, start: int, end: int) -> bytearray:
        """The raw 8-byte little-endian entries of the pages overlapping ``[start, end)``."""
        first = start // PAGE_SIZE
        last = (end + PAGE_SIZE - 1) // PAGE_SIZE
        count = max(0, last - first)
        if count == 0:
            return bytearray()
        want = count * _ENTRY
        buf = bytearray(want)
        view = memoryview(buf)
        got = 0
        while got < want:
            try:
                n = os.preadv(self._fd, [view[got:]], first * _ENTRY + got)
            except OSError as exc:
                raise ProcReadError(f"{self.path}: {exc.strerror} at page {first + got // _ENTRY}") from None
            if n <= 0:
                break
            got += n
        view.release()
        del buf[got - got % _ENTRY :]
        return buf

    def scan(self, start: int, end: int, wanted: int = SCAN_PRESENT | SCAN_SWAPPED) -> list[tuple[int, int, int]] | None:
        """Runs ``(start, end, categories)`` of present or swapped pages in ``[start, end)``
        (``categories`` is ``SCAN_PRESENT`` or ``SCAN_SWAPPED``); pages in no run are
        neither; with ``wanted=SCAN_PFNZERO``, the runs of pages that map the zero page.
        ``None`` where the kernel has no ``PAGEMAP_SCAN`` (before 6.7) or refuses it: the
        caller reads entries instead, and this reader stops asking. Areas the kernel's scan
        skips (``VM_PFNMAP``) show no run.
        """
        if not self._scan_supported:
            return None
        lo = start // PAGE_SIZE * PAGE_SIZE
        hi = (end + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
        vec = array("Q", bytes(24 * _SCAN_REGIONS))
        address = vec.buffer_info()[0]
        runs: list[tuple[int, int, int]] = []
        while lo < hi:
            arg = bytearray(_SCAN_ARG.pack(_SCAN_ARG.size, 0, lo, hi, 0, address, _SCAN_REGIONS,
                                           0, 0, 0, wanted, wanted))
            try:
                count = fcntl.ioctl(self._fd, _PAGEMAP_SCAN, arg, True)
            except OSError:  # an older kernel (ENOTTY), or a sandbox that refuses the ioctl
                self._scan_supported = False
                return None
            runs.extend(zip(vec[0 : 3 * count : 3], vec[1 : 3 * count : 3], vec[2 : 3 * count : 3]))
            walk_end = _SCAN_ARG.unpack(arg)[4]
            if walk_end <= lo:
                break
            lo = walk_end
        return runs

    def private_copies(self, start: int, end: int) -> int:
        """Pages of ``[start, end)`` that are the process's own copies: present without
        the file bit, or swapped. In a private file mapping, the pages copied on write."""
        return self.read_bytes(start, end)[7::_ENTRY].translate(_PRIVATE_COPY).count(1)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "PagemapReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

