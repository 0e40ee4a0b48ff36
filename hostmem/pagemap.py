"""/proc/PID/pagemap: one 64-bit entry per virtual page, read in batches.

The bits used here (Documentation/admin-guide/mm/pagemap.rst):

- 63: page present in RAM
- 62: page swapped
- 61: page is a file page or shared anonymous (clear for a private copy-on-write page)
- 56: page exclusively mapped

A range is read with one ``pread`` into raw bytes; the classifiers (``residency``,
``areas``, ``host_aggregate``) decode whole batches of them at once, never one
``struct`` call per page.
"""

from __future__ import annotations

import os

from .procfs import PAGE_SIZE, ProcReadError, proc_path

__all__ = ["PagemapReader"]

_ENTRY = 8


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

