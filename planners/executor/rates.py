"""Rates the cost model needs, measured on this machine (``hostmem calibrate``).

- disk: a sequential read of a file whose pages were dropped first
  (``POSIX_FADV_DONTNEED`` after an fsync), in 8 MiB reads: the rate a streamed layer
  the page cache cannot keep comes back at;
- page cache: the same file read again, now cached;
- read-ahead: each of the executor's readers on a window of 32 MiB layers of that file,
  mapped read-only (pages dropped first): the fastest is what ``read_ahead: auto`` uses
  once ``--save`` has written it (:mod:`.readahead`); :func:`reader_rate` times one
  reader over a whole file, the rate the executor re-reads released layers at;
- host to device (a CUDA host): copies of a layer-sized buffer from pinned memory
  (``cudaHostAlloc``), from anonymous pageable memory, from a read-only file mapping,
  and from that mapping registered in place with ``cudaHostRegister`` (read-only).

A folder is measured on a probe file written there (refused where it would nearly fill the
disk; created under a random name, mode 0600, never through a link or over a file there) and
removed afterwards, also on a failure or an interrupt, or, for a
checkpoint folder, on its largest file as it is (read only; its pages are dropped, so
a server using it re-reads them).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import time
from typing import NamedTuple

from hostmem.errors import InputError

__all__ = ["FolderRates", "measure_file", "measure_folder", "probe_file", "probe_refusal", "h2d_rates", "reader_rate",
           "time_file_readers", "CHUNK"]

CHUNK = 8 << 20


class FolderRates(NamedTuple):
    folder: str
    file: str
    nbytes: int
    disk_read: float  # bytes/s, pages dropped first
    page_cache_read: float  # bytes/s, the same bytes cached
    probe: bool  # a file written for the measurement (removed), or an existing one
    readers: dict | None = None  # read-ahead reader -> seconds for the window timed

def _read_all(fd: int, nbytes: int, buf: memoryview) -> float:
    began, at = time.perf_counter(), 0
    while at < nbytes:
        got = os.preadv(fd, [buf[: min(CHUNK, nbytes - at)]], at)
        if got <= 0:
            break
        at += got
    return max(time.perf_counter() - began, 1e-9)


def measure_file(path: str, nbytes: int | None = None) -> tuple[int, float, float]:
    """``(bytes, disk rate, page-cache rate)`` of a sequential read of ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size if nbytes is None else min(nbytes, os.fstat(fd).st_size)
        if size <= 0:
            raise InputError(f"{path}: empty file; nothing to time a read of")
        buf = memoryview(bytearray(CHUNK))
        os.posix_fadvise(fd, 0, size, os.POSIX_FADV_SEQUENTIAL)
        os.fsync(fd)  # a page still dirty (a file written moments ago) would not be dropped
        cold = float("inf")
        for _ in range(2):  # the better of two: a shared disk only ever makes a read slower
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            cold = min(cold, _read_all(fd, size, buf))
        warm = _read_all(fd, size, buf)
        return size, size / cold, size / warm
    finally:
        os.close(fd)


_PROBE_HEADROOM = 64 << 20  # what a probe leaves free (a tenth of a smaller disk): a cache may write there too


def probe_refusal(folder: str, nbytes: int, option: str = "--size") -> str | None:
    """Why a probe of ``nbytes`` must not be written in ``folder`` (it would leave its disk less
    than 64 MiB free, or a tenth of a smaller disk), in one line saying what to do (``option``
    sets the size); None when it fits."""
    from hostmem.units import format_size

    st = os.statvfs(folder)
    free, keep = st.f_bavail * st.f_frsize, min(_PROBE_HEADROOM, st.f_blocks * st.f_frsize // 10)
    if nbytes + keep <= free:
        return None
    most = free - keep
    smaller = f"give a smaller {option} (at most {format_size(most)} here), " if most >= CHUNK else ""
    return (f"{folder}: {format_size(free)} free, too little for the {format_size(nbytes)} probe file "
            f"calibrate times there (a probe leaves {format_size(keep)} free); {smaller}free space "
            "there, or time another folder (--root DIR, --path DIR)")


_PROBE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _remove_probe(dir_fd: int, fd: int, name: str) -> None:
    """Unlink ``name`` in its folder while it is still the file ``fd`` created (another user who
    may write the folder could have put something else there since); with no ``fd`` (stopped
    as it was created), whatever holds the random name now: only this process knew it."""
    with contextlib.suppress(OSError):
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        ours = os.fstat(fd) if fd >= 0 else now
        if (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino):
            os.unlink(name, dir_fd=dir_fd)


@contextlib.contextmanager
def probe_file(folder: str, nbytes: int, option: str = "--size"):
    """A file of ``nbytes`` written and synced in ``folder`` for the measurement: its path.

    Refused before a byte is written when the disk has no room for it (:func:`probe_refusal`);
    created under a random name, mode 0600, never through a link or over a file already there
    (``O_EXCL | O_NOFOLLOW``), written through its own descriptor; removed after, and on any
    failure or interrupt while it is written or read. ``option`` is the one that sets
    ``nbytes``, named in the advice of a refusal.
    """
    from hostmem.units import format_size

    refusal = probe_refusal(folder, nbytes, option)
    if refusal:
        raise InputError(refusal)
    block = memoryview(os.urandom(1 << 20) * (CHUNK >> 20))
    dir_fd, fd, name = -1, -1, None
    try:
        try:
            dir_fd = os.open(folder, getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC)
            for _ in range(100):  # named first, so a stop while it is created still removes it
                name = f".hostmem-calibrate-{secrets.token_hex(8)}"
                try:
                    fd = os.open(name, _PROBE_FLAGS, 0o600, dir_fd=dir_fd)  # never follows, never truncates
                    break
                except FileExistsError:
                    name = None
            else:
                raise InputError(f"{folder}: 100 random probe names taken; remove the .hostmem-calibrate-* entries "
                                 "there, or time another folder (--root DIR, --path DIR)")
            at = 0
            while at < nbytes:
                at += os.write(fd, block[: min(CHUNK, nbytes - at)])
            os.fsync(fd)
        except OSError as exc:  # the disk filled meanwhile, a file size limit, an I/O error
            raise InputError(f"{folder}: could not write the {format_size(nbytes)} probe file calibrate times there "
                             f"({exc.strerror or exc}; what was written is removed); free space there, give a smaller "
                             f"{option}, or time another folder (--root DIR, --path DIR)") from None
        yield os.path.join(folder, name)
    finally:
        if name is not None:
            _remove_probe(dir_fd, fd, name)
        for opened in (fd, dir_fd):
            if opened >= 0:
                os.close(opened)


def _largest_file(folder: str) -> str | None:
    files = [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors")]
    files = [f for f in files if os.path.isfile(f)]
    return max(files, key=os.path.getsize) if files else None


def measure_folder(folder: str, nbytes: int, existing: bool = False) -> FolderRates:
    """Rates of ``folder``: its largest checkpoint file when ``existing``, else a probe written there."""
    if not os.path.isdir(folder):
        raise InputError(f"{folder}: not a folder; give a checkpoint folder or a cache root that exists")
    path = _largest_file(folder) if existing else None
    probe = path is None
    if probe and not os.access(folder, os.W_OK):
        raise InputError(f"{folder}: not writable and holds no .safetensors file to time a read of")
    with probe_file(folder, nbytes) if probe else contextlib.nullcontext(path) as path:
        size, disk, cached = measure_file(path, nbytes)
        readers = time_file_readers(path, min(size, _WINDOW))
    return FolderRates(folder, path, size, disk, cached, probe, readers)


_WINDOW = 64 << 20  # two layers of 32 MiB: a read-ahead window


@contextlib.contextmanager
def _window(path: str, nbytes: int):
    """The first ``nbytes`` of ``path`` mapped read-only here, as 32 MiB layers advised as the
    executor advises a released layer (:func:`.readahead.set_random`): ``(ranges, handles)``."""
    import ctypes

    from .layout import FileRange
    from .readahead import FileHandles, set_random

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    address = libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    os.close(fd)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"{path}: could not map {nbytes} bytes to time the readers")
    handles = FileHandles()
    try:
        ranges = [FileRange(path, at, min(32 << 20, nbytes - at), address + at, False)
                  for at in range(0, nbytes, 32 << 20)]
        set_random(ranges, True)
        yield ranges, handles
    finally:
        handles.close()
        libc.munmap(address, nbytes)


def time_file_readers(path: str, nbytes: int) -> dict[str, float]:
    """Seconds per reader to read the first ``nbytes`` of ``path`` as a read-ahead window of
    32 MiB layers (:func:`.readahead.time_readers`), on a read-only mapping made here."""
    from .readahead import time_readers

    with _window(path, nbytes) as (ranges, handles):
        return time_readers(ranges, handles)


def reader_rate(path: str, how: str = "parallel", nbytes: int | None = None) -> float:
    """Bytes per second at which reader ``how`` reads the first ``nbytes`` of ``path`` (all of
    it by default) back into the page cache, as the executor re-reads its released layers:
    32 MiB layers, pages dropped first, the better of two. The file's pages are dropped
    after, its partial last page too."""
    from .readahead import time_reader

    size = os.path.getsize(path) if nbytes is None else min(nbytes, os.path.getsize(path))
    if size <= 0:
        raise InputError(f"{path}: empty file; nothing to time a read of")
    try:
        with _window(path, size) as (ranges, handles):
            return size / min(time_reader(how, ranges, handles) for _ in range(2))
    finally:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _time_copy(dst, src, repeats: int = 3) -> float:
    import torch

    dst.copy_(src, non_blocking=True)  # warm: first-touch and driver setup out of the timing
    torch.cuda.synchronize(dst.device)
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)
        best = min(best, time.perf_counter() - began)
    return src.numel() / best


def h2d_rates(device: str, layer_bytes: int, mapped_file: str) -> dict[str, float]:
    """Host-to-device rates (bytes/s) at ``layer_bytes`` from each kind of host memory (CUDA only).

    ``mapped_file`` is a file of at least ``layer_bytes``, mapped read-only here.
    """
    import warnings

    import torch

    from hostmem.pinning import CudaHostRegisterBackend

    dst = torch.empty(layer_bytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(layer_bytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.ones(layer_bytes, dtype=torch.uint8)
    out = {"pinned_h2d": _time_copy(dst, pinned), "pageable_h2d": _time_copy(dst, pageable)}
    with open(mapped_file, "rb") as handle:
        area = mmap.mmap(handle.fileno(), layer_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # not writable: that is the point
            view = torch.frombuffer(area, dtype=torch.uint8)
        out["mapped_pageable_h2d"] = _time_copy(dst, view)
        backend = CudaHostRegisterBackend()
        backend.lock(view.data_ptr(), layer_bytes)
        try:
            out["mapped_registered_h2d"] = _time_copy(dst, view)
        finally:
            backend.unlock(view.data_ptr(), layer_bytes)
        del view
    finally:
        area.close()
    return out
