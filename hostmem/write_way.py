"""How to write gigabytes that must end up on disk and in the page cache: through the
page cache, or around it and read back.

The demo's files (every scenario maps them, and they must start alike) and a cache
build's layers where the page cache holds them (:mod:`hostmem.vault.read_ahead`) both
must end up there. Two ways get them there, and which is faster depends on the machine,
not on what was fastest elsewhere:

- ``buffered``: written through the page cache, which the kernel writes back. On a
  virtual disk the writeback can be far slower than the disk: 5-8 s per GiB on a
  2-core VM whose disk takes O_DIRECT writes at 0.4-0.6 s per GiB, so writing the
  default 5 GiB took most of ``make demo``'s time;
- ``direct``: written with O_DIRECT (the disk reads the bytes from our buffer), then
  read back into the page cache by a few readers at once (one reader with the kernel's
  readahead ran at a third of two readers' rate there).

Other machines of the same kind went the other way: buffered 0.8-1.5 s per GiB, direct
and read back 2.3-2.9 s per GiB.

:func:`measure` times both, each on a scratch file made durable (fsync) and, for
``direct``, read back, twice in alternating order; :func:`WayChoice.faster` is the way
with the smaller total.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass

WAYS = ("buffered", "direct")
TRIAL_BYTES = 128 * 1024 * 1024  # per trial file; two rounds of each way
_READ = 8 * 1024 * 1024
_READERS = 2


@dataclass(frozen=True)
class WayChoice:
    """Seconds per GiB each way took on this machine, in the folder measured."""

    seconds_per_gib: dict[str, float]

    @property
    def faster(self) -> str:
        return min(WAYS, key=lambda way: self.seconds_per_gib[way])


def read_back(path: str, readers: int = _READERS) -> None:
    """Read all of ``path`` into the page cache, ``readers`` stretches at once."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        step = -(-size // readers // _READ) * _READ or _READ

        def read(start: int) -> None:
            buffer = bytearray(_READ)
            offset, end = start, min(size, start + step)
            while offset < end:
                got = os.preadv(fd, [memoryview(buffer)[: min(_READ, end - offset)]], offset)
                if got == 0:
                    return
                offset += got

        threads = [threading.Thread(target=read, args=(start,)) for start in range(0, size, step)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        os.close(fd)


def _trial(folder: str, way: str, data: memoryview) -> float:
    """Seconds to write ``data`` into a new file in ``folder`` ``way`` and make it durable
    (and, for ``direct``, read it back). The file has a temporary's name and holds its
    writer's lock while it exists, as the vault's temporaries do, so a cache's sweep
    removes it should this process die before it does (:mod:`hostmem.vault.durable`)."""
    from hostmem.vault.durable import discard, open_tmp, write_all, write_uncached_pieces

    began = time.perf_counter()
    fd, path = open_tmp(folder)
    try:
        if way == "direct":
            write_uncached_pieces(fd, path, [data])
        else:
            write_all(fd, data, 0, writeback=True)
        os.fsync(fd)
        if way == "direct":
            read_back(path)
        return time.perf_counter() - began
    finally:
        discard(path)
        os.close(fd)  # after the unlink: the lock covers the name while it exists


def measure(folder: str, nbytes: int = TRIAL_BYTES) -> WayChoice:
    """Time both ways into ``folder`` (scratch files, removed), ``nbytes`` a trial, two
    trials each in alternating order; see the module docstring."""
    scratch = mmap.mmap(-1, nbytes)
    try:
        for at in range(0, nbytes, 1 << 20):  # incompressible, like weights
            scratch[at : at + (1 << 20)] = os.urandom(min(1 << 20, nbytes - at))
        data = memoryview(scratch)
        totals = dict.fromkeys(WAYS, 0.0)
        for order in (WAYS, WAYS[::-1]):
            for way in order:
                totals[way] += _trial(folder, way, data)
        data.release()
    finally:
        scratch.close()
    gib = 2 * nbytes / (1 << 30)
    return WayChoice({way: seconds / gib for way, seconds in totals.items()})
