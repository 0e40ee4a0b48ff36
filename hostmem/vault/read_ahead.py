"""Merged layers read back where the page cache can hold them: ahead of use, in use order.

A layer the vault serves is a mapping of its own small file. Read cold by the first
pass over the model, each file is faulted in on its own: the kernel's read-ahead
starts small in every file and never crosses into the next, so the disk holds one
layer's read at a time. Measured on a 2-core virtual machine, 512 files of 2 MiB read
cold by one pass took 0.4-1.0 s where the one checkpoint of the same bytes took
0.2-0.3 s, and a build's own layers (written with ``O_DIRECT``, so none of them in the
page cache) took 5-6 s to read back under load. So the vault asks the kernel to read
each layer in as soon as it hands the layer out (a hit's ``get``, a build's seal), in
that order, which is the order the model uses them: ``MADV_WILLNEED`` starts the reads
and returns, on a thread of its own, so every layer is in the disk's queue at once and
the pass finds its pages in memory or on their way.

How much: the layers of a session in use order until they add up to
:data:`PAGE_CACHE_SHARE` of the room the page cache has (:func:`page_cache_room`:
``MemAvailable``, and in a memory cgroup with a limit, the limit less what the group
cannot reclaim; the tighter). A combination that fits is read in whole, and a build's
layers are left in the page cache: written through it, or written with ``O_DIRECT`` and
read back once sealed, whichever the machine does faster (:mod:`hostmem.write_way`; on
some virtual machines a buffered write costs ~3 s per GiB against ~0.5 s for
``O_DIRECT`` and the read back, on others 0.8-1.5 s against 2.3-2.9 s). Written through
the page cache, a layer claims its bytes of the budget as it is written
(:meth:`ReadAhead.claim`). One that does not fit is read
ahead up to the share only: the rest is left to a planner's executor, which reads
ahead and releases layers in step with the pass (reading a model larger than the
cache whole would evict its first layers before the pass reaches them).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import mmap
import queue
import threading

from hostmem.procfs.cgroup import read_cgroup_memory
from hostmem.procfs.status import read_meminfo

__all__ = ["PAGE_CACHE_SHARE", "ReadAhead", "drain", "page_cache_room", "will_need"]

PAGE_CACHE_SHARE = 0.5  # of the page cache's room: the rest for the base, activations and what else runs
_PAGE = 4096


def page_cache_room() -> int:
    """Bytes this process can have in the page cache without pushing out what is in use:
    ``MemAvailable``, or where its memory cgroup has a limit, that limit less what the
    group holds and cannot reclaim, if that is tighter (a cgroup charges page cache too)."""
    room = read_meminfo().available
    with contextlib.suppress(OSError):
        group = read_cgroup_memory()
        if group is not None and group.limit_bytes is not None:
            room = min(room, group.limit_bytes - group.unreclaimable_bytes)
    return max(0, room)


class ReadAhead:
    """One session's read-ahead: each mapped layer handed to :meth:`add`, in order, until
    ``budget`` bytes (default: :data:`PAGE_CACHE_SHARE` of :func:`page_cache_room`, taken at
    the first layer). ``bytes`` is what was asked for so far."""

    def __init__(self, budget: int | None = None):
        self._budget = budget
        self.bytes = 0

    def add(self, tensor) -> bool:
        """Ask for ``tensor``'s pages (a CPU view of a file mapping) to be read in, after the
        layers added before it; False once the budget is spent (nothing asked)."""
        nbytes = tensor.numel() * tensor.element_size()
        if not nbytes or tensor.device.type != "cpu" or not self.claim(nbytes):
            return False
        _worker().put(_span(tensor))
        return True

    def claim(self, nbytes: int) -> bool:
        """Count ``nbytes`` against the budget (a write that leaves them in the page cache
        claims them so, and asks nothing of the kernel); False once they do not fit."""
        if self._budget is None:
            self._budget = int(PAGE_CACHE_SHARE * page_cache_room())
        if self.bytes + nbytes > self._budget:
            self._budget = self.bytes  # in use order: nothing after the first layer that does not fit
            return False
        self.bytes += nbytes
        return True


class _Worker:
    """The process's one read-ahead thread: advises the address ranges put to it, in order.
    A queued range holds no reference to its mapping: a model dropped meanwhile unmaps it
    at once (a folder it lies on can be unmounted), and advice on a range no longer mapped,
    or mapped again to something else, is a hint that changes no byte."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False
        atexit.register(self.stop)

    def put(self, item) -> None:
        """Queue a range to advise, or an event to set once everything before it was advised."""
        self._queue.put(item)
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="hostmem-vault-read-ahead", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """At the interpreter's exit: end the thread before Python finalizes (a daemon thread
        still at work then can abort the process), dropping what it was yet to advise."""
        with self._lock:
            self._stopped, thread = True, self._thread
        self._queue.put(None)
        if thread is not None:
            thread.join(5.0)

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=1.0)
            except queue.Empty:
                with self._lock:  # ends when idle; a later put starts a new one
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if item is None or self._stopped:
                return
            if isinstance(item, threading.Event):
                item.set()
            else:
                _advise(*item)


@functools.cache
def _worker() -> _Worker:
    return _Worker()


def drain(timeout: float = 10.0) -> bool:
    """Wait until every layer queued so far was advised (tests, benchmarks); False on a timeout."""
    done = threading.Event()
    _worker().put(done)
    return done.wait(timeout)


@functools.cache
def _madvise():
    call = ctypes.CDLL(None, use_errno=True).madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


def _span(tensor) -> tuple[int, int]:
    """``(start, length)`` of ``tensor``'s whole pages."""
    start = tensor.data_ptr() // _PAGE * _PAGE
    return start, tensor.data_ptr() + tensor.numel() * tensor.element_size() - start


def _advise(start: int, length: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        _madvise()(ctypes.c_void_p(start), ctypes.c_size_t(length), mmap.MADV_WILLNEED)


def will_need(tensor) -> None:
    """``MADV_WILLNEED`` over ``tensor``'s whole pages: the kernel starts reading a file
    mapping's pages in and returns (a hint: an error changes nothing, and is dropped;
    an empty tensor or one in a device's memory is left alone)."""
    if tensor.device.type == "cpu" and tensor.numel():
        _advise(*_span(tensor))
