"""Read a layer's file ranges ahead of use, and release them after.

Reading ahead has two halves: ``advise`` starts the reads and returns (called when a
layer enters the read-ahead window, so that every layer of the window is in the disk's
queue at once), and ``complete`` returns once the bytes are in (run on the worker
thread, so that the disk works while the previous layer computes). Three readers:

- ``madvise``: ``madvise(MADV_WILLNEED)`` on the layer's pages, then one touch per page;
- ``fadvise``: ``posix_fadvise(POSIX_FADV_WILLNEED)`` on the file range, then the touch;
- ``read``: nothing ahead, then ``preadv`` of the range into one small reusable buffer
  (the page cache keeps what was read; the buffer is overwritten by the next chunk);
- ``fault``: nothing ahead, then the touch alone, on the worker: the kernel's own fault
  path reads, in 2 MiB folios where the mapping asked for huge pages (advice reads 4 KiB
  pages one by one);
- ``parallel``: the same touch, the layer cut at 2 MiB folio boundaries and the pieces
  queued, when the layer enters the window, on a few reader threads that touch them in
  pass order: one fault reads one folio and waits for it, so a single thread keeps one
  read in the disk's queue, while the pool keeps several, across layer boundaries,
  and a disk (a virtual one above all) reads several at once faster than in turn.

Every reader needs a layer's file pages to come in large reads. A fault on a mapping
advised ``MADV_HUGEPAGE`` reads a 2 MiB folio, even under ``MADV_RANDOM`` (which stops
the kernel's read-around past the layer); without that advice it reads one 4 KiB page
and waits for it: ``safetensors.torch.load_file`` (what diffusers users have) hands out
such a private mapping, where a fault-driven reader crawled at 0.15 GB/s. So
:func:`set_random` advises both on every kept and released layer: on hostmem's own
mapping (huge pages already asked for) nothing changes; on safetensors' the same
readers read 2 MiB at a time. The hugepage advice stays after the executor (there is
no advice that restores "none"): later faults there read in 2 MiB folios too.

``auto`` is decided once per machine, not at every start: ``hostmem calibrate`` times
the readers on a window of 32 MiB layers (:func:`time_readers`) and saves the fastest
in its record (:mod:`.calibration`); without a record ``auto`` is ``parallel``, which
keeps several folio reads in the disk's queue on either mapping. Reading the record
costs one small file read: identical runs make the identical choice.

Release: ``MADV_DONTNEED`` unmaps the layer's pages from this process (a read-only
mapping loses nothing: the page cache still holds the bytes), then
``POSIX_FADV_DONTNEED`` drops them from the page cache. A private mapping (what
diffusers' loader leaves; one made read-only since by ``mprotect`` too, whose earlier
writes stay) may hold a page a write made anonymous, which
``MADV_DONTNEED`` would silently revert to the file's bytes: such a range is first
looked up in /proc/self/pagemap (one read of 8 bytes a page), and where any page of it is
a private copy (present and not the file's, or swapped) it is released with
``MADV_PAGEOUT``, which reclaims only the file's own pages. A range without one is
released as a read-only one is: ``MADV_PAGEOUT`` walks and reclaims page by page, and
on a 2 GiB model it cost 0.09 s a pass where the two calls cost 0.01 s. On a private
mapping the lookup and the unmapping run on the thread that runs the layers, right after
the layer's forward: a write to that layer's weights from the model's own code has either
happened (and is seen) or comes after the release (and copies the file's bytes, as any
write would). The page cache's half (``uncache``) and a shared mapping's whole release
lose no write on any thread (the executor runs them on its worker).
Only whole pages inside the layer are released, never a neighbour's.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from hostmem.errors import InputError
from hostmem.pagemap import PagemapReader
from hostmem.procfs import PAGE_SIZE, ProcReadError

from .layout import FileRange, inner_pages, outer_pages

__all__ = ["FileHandles", "advise", "set_random", "complete", "read_ahead", "release", "choose_reader", "READERS",
           "DEFAULT_READER", "cancel", "drop_range", "time_reader", "time_readers", "uncache_ranges"]

READERS = ("madvise", "fadvise", "read", "fault", "parallel")
DEFAULT_READER = "parallel"  # auto without a calibration record: see the module doc
_MADV_PAGEOUT = 21
_MADV_HUGEPAGE = 14
_CHUNK = 1 << 20  # the reusable buffer: small, so a read adds less anonymous memory than a layer
_FOLIO = 2 << 20  # the largest folio a huge-page mapping's faults read
_FAULTERS = 4  # reader threads of ``parallel``: reads in the disk's queue at once
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def _madvise(address: int, length: int, advice: int, what: str) -> None:
    if length and _libc.madvise(address, length, advice) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"madvise({what}) of {length} bytes at {address:#x}: {os.strerror(code)}")


class FileHandles:
    """One read-only descriptor per checkpoint file, and a reusable read buffer."""

    def __init__(self):
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._buffer: bytearray | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.inflight: dict[FileRange, tuple] = {}  # parallel: (pieces queued, their jobs), not yet waited for
        self._pagemap: PagemapReader | None = None  # private mappings' releases look here first

    def fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                # no kernel read-ahead on this descriptor: a read brings in the layer and no more
                # (read_ahead_kb can be 8 MiB: two layers past the one asked for, never released)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                self._fds[path] = fd
            return self._fds[path]

    def buffer(self) -> memoryview:
        if self._buffer is None:
            self._buffer = bytearray(_CHUNK)  # touched once here, reused for every read
        return memoryview(self._buffer)

    def private_copies(self, address: int, length: int) -> int:
        """Pages of ``[address, address + length)`` a write made this process's own (see the module doc)."""
        with self._lock:
            if self._pagemap is None:
                self._pagemap = PagemapReader()
            pagemap = self._pagemap
        return pagemap.private_copies(address, address + length)

    def pool(self) -> ThreadPoolExecutor:
        """The reader threads of ``parallel`` (made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=_FAULTERS, thread_name_prefix="hostmem-fault")
            return self._pool

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._buffer = None
            if self._pagemap is not None:
                self._pagemap.close()
                self._pagemap = None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _touch(address: int, length: int) -> None:
    """Read one byte of every page (in C, without the GIL): returns once all are resident."""
    if length <= 0:
        return
    view = (ctypes.c_char * length).from_address(address)
    flat = torch.frombuffer(view, dtype=torch.uint8)
    flat[::PAGE_SIZE].sum()


def _advise_madvise(r: FileRange, handles: FileHandles) -> None:
    start = r.address - r.address % PAGE_SIZE
    _madvise(start, r.address + r.length - start, mmap.MADV_WILLNEED, "MADV_WILLNEED")


def _advise_fadvise(r: FileRange, handles: FileHandles) -> None:
    os.posix_fadvise(handles.fd(r.path), r.offset, r.length, os.POSIX_FADV_WILLNEED)


def _touch_range(r: FileRange, handles: FileHandles) -> None:
    _touch(r.address, r.length)


def _pieces(r: FileRange) -> list[tuple[int, int]]:
    """``(address, length)`` pieces of ``r`` cut at 2 MiB folio boundaries."""
    end = r.address + r.length
    bounds = [r.address, *range(r.address - r.address % _FOLIO + _FOLIO, end, _FOLIO), end]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def _touch_queue(queue: collections.deque) -> None:
    """Touch the pieces taken from ``queue``, in its order, until it is empty."""
    while True:
        try:
            address, length = queue.popleft()  # atomic: the layer's other jobs take the others
        except IndexError:
            return
        _touch(address, length)


def _advise_parallel(r: FileRange, handles: FileHandles) -> None:
    """Queue the touch of every piece of ``r`` on the reader threads (pass order: first in, first read).

    The pieces wait in one queue that as many jobs as there are reader threads drain:
    one job a piece cost the layer's pre-hook a submit and a wait for each 2 MiB."""
    pool = handles.pool()
    queue = collections.deque(_pieces(r))
    handles.inflight[r] = queue, [pool.submit(_touch_queue, queue) for _ in range(min(_FAULTERS, len(queue)))]


def _wait_parallel(r: FileRange, handles: FileHandles) -> None:
    entry = handles.inflight.pop(r, None)
    if entry is None:  # not advised (a drain, a timing): start it now
        _advise_parallel(r, handles)
        entry = handles.inflight.pop(r)
    for job in entry[1]:
        job.result()


def cancel(ranges, handles: FileHandles) -> None:
    """Stop reading ``ranges`` ahead (``parallel``; the other readers' advice is the kernel's):
    the pieces no thread has taken stay unread, and those being read are in on return, so a
    release that follows misses no page still on its way in."""
    for r in ranges:
        entry = handles.inflight.pop(r, None)
        if entry is None:
            continue
        queue, jobs = entry
        queue.clear()
        for job in jobs:
            if not job.cancel():
                try:
                    job.result()
                except Exception:  # noqa: BLE001 - a read that failed has nothing to release
                    pass


def _read_pread(r: FileRange, handles: FileHandles) -> None:
    fd, buf = handles.fd(r.path), handles.buffer()
    at, end = r.offset, r.offset + r.length
    while at < end:
        got = os.preadv(fd, [buf[: min(_CHUNK, end - at)]], at)
        if got <= 0:
            raise OSError(f"{r.path}: short read at byte {at} (the file shrank under its mapping?)")
        at += got


# reader -> (advise: start the reads, complete: return once the bytes are in)
_READERS = {
    "madvise": (_advise_madvise, _touch_range),
    "fadvise": (_advise_fadvise, _touch_range),
    "read": (None, _read_pread),
    "fault": (None, _touch_range),
    "parallel": (_advise_parallel, _wait_parallel),
}


def advise(ranges, handles: FileHandles, how: str) -> None:
    """Start reading ``ranges`` (returns before the bytes are in; nothing for ``read``)."""
    start = _READERS[how][0]
    if start is not None:
        for r in ranges:
            start(r, handles)


def complete(ranges, handles: FileHandles, how: str) -> int:
    """Return once ``ranges`` are in the page cache; the bytes asked for."""
    finish = _READERS[how][1]
    for r in ranges:
        finish(r, handles)
    return sum(r.length for r in ranges)


def read_ahead(ranges, handles: FileHandles, how: str) -> int:
    """Both halves at once: bring ``ranges`` into the page cache; the bytes asked for."""
    advise(ranges, handles, how)
    return complete(ranges, handles, how)


def set_random(ranges, on: bool) -> None:
    """``MADV_RANDOM`` and ``MADV_HUGEPAGE`` (``on``), or ``MADV_NORMAL``, on every page
    ``ranges`` touch, the partial pages at their ends included.

    A kept or released layer is read by the executor alone: the kernel's own read-around
    on a fault (up to ``read_ahead_kb`` past it) would read layers the plan has not made
    room for, and the group would reach its limit (the more so with several reader
    threads faulting at once). The hugepage advice makes each fault read a 2 MiB folio,
    where a plain private mapping would read 4 KiB (see the module doc); it is left on.
    A layer starts and ends mid-page: a fault in an end page left without the advice
    reads around it (``read_ahead_kb``, 8 MiB on a virtual disk) in 4 KiB folios, into
    the layers beside it, which then stay small (on safetensors' mapping, 0.27-0.30 s a
    pass against 0.18-0.22 s with the ends advised too).
    """
    for r in ranges:
        address, length = outer_pages(r)
        if on:
            _madvise(address, length, mmap.MADV_RANDOM, "MADV_RANDOM")
            _hugepage(address, length)
        elif length and _libc.madvise(address, length, mmap.MADV_NORMAL) != 0:
            code = ctypes.get_errno()
            if code != errno.ENOMEM:  # ENOMEM: no longer mapped (the model let its mapping go): nothing to undo
                raise OSError(code, f"madvise(MADV_NORMAL) of {length} bytes at {address:#x}: {os.strerror(code)}")


def _hugepage(address: int, length: int) -> None:
    """``MADV_HUGEPAGE``, where the kernel has transparent huge pages (EINVAL without: 4 KiB reads stay)."""
    if length and _libc.madvise(address, length, _MADV_HUGEPAGE) != 0:
        code = ctypes.get_errno()
        if code != errno.EINVAL:
            raise OSError(code, f"madvise(MADV_HUGEPAGE) of {length} bytes at {address:#x}: {os.strerror(code)}")


def _may_hold_copies(handles: FileHandles, address: int, length: int) -> bool:
    """Whether a write may have made a page of the range anonymous (yes where pagemap cannot tell)."""
    try:
        return handles.private_copies(address, length) > 0
    except ProcReadError:
        return True


def _drop(r: FileRange, handles: FileHandles, address: int, length: int, uncache: list | None) -> int:
    if r.private and _may_hold_copies(handles, address, length):
        _madvise(address, length, _MADV_PAGEOUT, "MADV_PAGEOUT")  # keeps what a write made anonymous
        return length
    _madvise(address, length, mmap.MADV_DONTNEED, "MADV_DONTNEED")
    where = (handles.fd(r.path), r.offset + (address - r.address), length)
    if uncache is None:
        os.posix_fadvise(*where, os.POSIX_FADV_DONTNEED)
    else:
        uncache.append(where)
    return length


def drop_range(r: FileRange, handles: FileHandles, back: bool = False, uncache: list | None = None) -> int:
    """Release the whole pages inside ``r`` from this process and the page cache; return their bytes.

    A 2 MiB folio that straddles the start of ``r`` is only dropped whole, so ``back``
    extends the release down to the folio's start (into the layer before, already used
    this pass); where that fails (a pinned neighbour: locked pages refuse MADV_DONTNEED)
    the pages inside ``r`` alone are released.

    With ``uncache`` (a list), the page cache's half is left to the caller: each file
    range to drop from it is appended, for :func:`uncache_ranges` (on another thread:
    ``POSIX_FADV_DONTNEED`` drops only pages no process maps, so a page faulted in
    again meanwhile stays, and an anonymous copy is never in the file's page cache).
    """
    address, length = inner_pages(r)
    if not length:
        return 0
    if back and address % _FOLIO:
        start = address - address % _FOLIO
        try:
            _drop(r, handles, start, length + address - start, uncache)
            return length
        except OSError:
            pass
    return _drop(r, handles, address, length, uncache)


def uncache_ranges(uncache: list) -> None:
    """Drop from the page cache the file ranges :func:`drop_range` left in ``uncache``."""
    for fd, offset, length in uncache:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def release(ranges, handles: FileHandles, back: bool = False) -> int:
    """Release every range of a layer after use; return the bytes released (see :func:`drop_range`)."""
    return sum(drop_range(r, handles, back) for r in ranges)


def time_reader(how: str, sample: list[FileRange], handles: FileHandles) -> float:
    """Seconds for reader ``how`` to read ``sample`` (its pages dropped first) as a window:
    every layer's reads started, then waited for in turn."""
    for r in sample:
        drop_range(r, handles)
    began = time.perf_counter()
    advise(sample, handles, how)
    complete(sample, handles, how)
    return time.perf_counter() - began


_SAMPLE = 64 << 20  # the layers timed, at most: a few, so that one slow read decides less


def _sample(sample) -> list[FileRange]:
    ranges = [sample] if isinstance(sample, FileRange) else list(sample or ())
    out, total = [], 0
    for r in ranges:
        r = r._replace(length=min(r.length, 32 << 20))  # a layer, up to 32 MiB
        if out and (total + r.length > _SAMPLE or r.path != out[0].path):
            break
        out.append(r)
        total += r.length
    return out


def time_readers(sample, handles: FileHandles) -> dict[str, float]:
    """Seconds of the best of three reads of ``sample`` (the ranges of a read-ahead window of
    released layers, up to 64 MiB of one file, each advised as :func:`set_random` does),
    per reader, in turn, pages dropped before each: what ``hostmem calibrate`` saves."""
    sample = _sample(sample)
    times: dict[str, float] = {h: float("inf") for h in READERS}
    for _ in range(3):  # the best of three, in turn: a shared disk only ever makes a read slower
        for h in READERS:
            times[h] = min(times[h], time_reader(h, sample, handles))
    for r in sample:
        drop_range(r, handles)
    return times


def choose_reader(how: str = "auto", saved: str | None = None) -> str:
    """The reader to use: ``how`` when it names one, else (``auto``) the one ``hostmem
    calibrate`` saved for this machine (``saved``), else :data:`DEFAULT_READER`. Nothing is
    read or timed here: identical runs choose alike, at no cost."""
    if how != "auto":
        if how not in READERS:
            raise InputError(f"read_ahead {how!r}: choose auto, {' or '.join(READERS)}")
        return how
    return saved if saved in READERS else DEFAULT_READER
