"""Pinning backends: page-lock tensors in place, at exact size, and count what was locked.

torch's caching host allocator rounds pinned blocks up to a power of two, so the
bytes locked can be 1.7-1.9x the bytes asked for, and ``tensor.pin_memory()`` makes
a copy. The backends here lock a tensor's own pages instead, no copy and nothing
rounded beyond the page:

- :class:`MlockBackend` (a CPU host): ``mlock``/``munlock`` through libc. Locking a
  read-only shared file mapping locks its page-cache pages (VmFlags ``lo``): the
  pinned copy *is* the page cache, so a pin costs the layer's bytes once and leaves
  no second copy to drop.
- :class:`CudaHostRegisterBackend` (a CUDA host): ``cudaHostRegister`` in place, read-only
  where the mapping is read-only, so the driver never asks for write access to a
  checkpoint's pages.

:class:`Pinner` keeps the books: a page shared by two tensors (or two layers) is
locked once, unpinning one layer keeps the pages its neighbours still need, and
``locked_bytes`` is what the kernel was asked to lock, not the tensors' sizes.

A pin made as a copy (``pin_memory()``, ``cudaHostAlloc``) leaves the original's page
cache behind: reclaimable, but resident until pressure comes. :func:`drop_page_cache`
releases it at once (``madvise(MADV_PAGEOUT)``) and returns the bytes released.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource

import torch

from .errors import HostmemError
from .procfs import PAGE_SIZE, read_status
from .residency import classify_range
from .units import format_size

__all__ = [
    "PinError",
    "MlockBackend",
    "CudaHostRegisterBackend",
    "default_backend",
    "Pinner",
    "page_span",
    "drop_page_cache",
]

_MADV_PAGEOUT = 21
_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


class PinError(HostmemError, OSError):
    """A pin or unpin failed; the message says why and what to do."""


def page_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``(start, end)`` of the whole pages under the tensor's storage."""
    storage = tensor.untyped_storage()
    start = storage.data_ptr()
    end = start + storage.nbytes()
    return start - start % PAGE_SIZE, end + (-end) % PAGE_SIZE


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("mlock", "munlock"):
        getattr(libc, name).argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        getattr(libc, name).restype = ctypes.c_int
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def _limit_text(value: int) -> str:
    return "unlimited" if value == resource.RLIM_INFINITY else format_size(value)


def _mlock_refused(code: int, start: int, length: int) -> PinError:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    locked = read_status().vm_lck
    over = soft != resource.RLIM_INFINITY and locked + length > soft
    why = (
        f"RLIMIT_MEMLOCK is {_limit_text(soft)} (hard {_limit_text(hard)}) and {format_size(locked)} is "
        "already locked; raise it (ulimit -l unlimited, LimitMEMLOCK=infinity in a systemd unit, "
        "docker run --ulimit memlock=-1) or grant CAP_IPC_LOCK, or pin less (host.max_pinned)"
        if over or code == errno.EPERM
        else "part of the range is not mapped, or the kernel is out of memory"
    )
    return PinError(code, f"mlock of {format_size(length)} at {start:#x} failed ({errno.errorcode.get(code, code)}): {why}")


class MlockBackend:
    """Lock pages with ``mlock(2)``; bounded by RLIMIT_MEMLOCK unless CAP_IPC_LOCK is held."""

    name = "mlock"

    def __init__(self):
        self._libc = _libc()

    def lock(self, start: int, length: int) -> None:
        if self._libc.mlock(start, length) != 0:
            raise _mlock_refused(ctypes.get_errno(), start, length)

    def unlock(self, start: int, length: int) -> None:
        if self._libc.munlock(start, length) != 0:
            code = ctypes.get_errno()
            raise PinError(code, f"munlock of {format_size(length)} at {start:#x} failed: {os.strerror(code)}")


def _writable(start: int, end: int) -> bool:
    """True when every area under ``[start, end)`` is mapped writable (from /proc/self/maps)."""
    with open("/proc/self/maps", "r", encoding="utf-8", errors="replace") as handle:
        for line in handle:
            span, perms = line.split(None, 2)[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo < end and hi > start and perms[1] != "w":
                return False
    return True


class CudaHostRegisterBackend:
    """Register pages with ``cudaHostRegister`` in place (portable; read-only when mapped so)."""

    name = "cuda"

    def __init__(self):
        if not torch.cuda.is_available():
            raise PinError(errno.ENODEV, "no CUDA device: cudaHostRegister needs one; use MlockBackend on a CPU host")
        self._cudart = torch.cuda.cudart()

    def _check(self, code, what: str) -> None:
        code = int(code)
        if code != 0:
            raise PinError(errno.EIO, f"{what} failed with cudaError {code}: {torch.cuda.CudaError(code)}")

    def lock(self, start: int, length: int) -> None:
        flags = _CUDA_HOST_REGISTER_PORTABLE
        if not _writable(start, start + length):
            flags |= _CUDA_HOST_REGISTER_READ_ONLY
        self._check(self._cudart.cudaHostRegister(start, length, flags), f"cudaHostRegister of {format_size(length)}")

    def unlock(self, start: int, length: int) -> None:
        self._check(self._cudart.cudaHostUnregister(start), f"cudaHostUnregister at {start:#x}")


def default_backend():
    """CUDA where a device is present, mlock on a CPU host."""
    return CudaHostRegisterBackend() if torch.cuda.is_available() else MlockBackend()


# ---------------------------------------------------------------- interval books


def _merge(spans) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out if e > s]


def _subtract(spans, minus) -> list[tuple[int, int]]:
    out, minus = [], _merge(minus)
    for start, end in _merge(spans):
        cursor = start
        for m_start, m_end in minus:
            if m_end <= cursor or m_start >= end:
                continue
            if m_start > cursor:
                out.append((cursor, m_start))
            cursor = max(cursor, m_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _intersect(spans, other) -> list[tuple[int, int]]:
    return _subtract(spans, _subtract(spans, other))


def _total(spans) -> int:
    return sum(e - s for s, e in spans)


class Pinner:
    """Pins named groups of CPU tensors in place and knows exactly which pages it locked.

    ``pin(key, tensors)`` locks the pages under the tensors' storages that no other
    key holds yet; ``unpin(key)`` releases the pages it locked and locks again, for
    their owners, pages that other keys still need. Use as a context manager to
    unpin everything on exit.
    """

    def __init__(self, backend=None):
        self.backend = backend if backend is not None else default_backend()
        self._wanted: dict = {}
        self._owned: dict = {}

    @property
    def locked_bytes(self) -> int:
        """Bytes of whole pages locked by this pinner."""
        return sum(_total(spans) for spans in self._owned.values())

    def keys(self) -> list:
        return list(self._owned)

    def _lock_all(self, spans) -> None:
        done = []
        try:
            for start, end in spans:
                self.backend.lock(start, end - start)
                done.append((start, end))
        except PinError:
            for start, end in done:
                self.backend.unlock(start, end - start)
            raise

    def _held(self) -> list[tuple[int, int]]:
        return [s for spans in self._owned.values() for s in spans]

    def would_lock(self, tensors) -> int:
        """Bytes that pinning ``tensors`` would newly lock (whole pages not held yet)."""
        wanted = _merge(page_span(t) for t in tensors if t.untyped_storage().nbytes())
        return _total(_subtract(wanted, self._held()))

    def pin(self, key, tensors) -> int:
        """Lock the pages under ``tensors``; return the bytes newly locked."""
        if key in self._owned:
            raise ValueError(f"{key!r} is already pinned")
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"{key!r}: a tensor on {t.device} has no host pages to pin")
        wanted = _merge(page_span(t) for t in tensors if t.untyped_storage().nbytes())
        new = _subtract(wanted, self._held())
        self._lock_all(new)
        self._wanted[key], self._owned[key] = wanted, new
        return _total(new)

    def unpin(self, key) -> int:
        """Release ``key``'s pages that no other key needs; return the bytes released."""
        owned = self._owned.pop(key)
        self._wanted.pop(key)
        for start, end in owned:
            self.backend.unlock(start, end - start)
        kept = 0
        for other, wanted in self._wanted.items():
            orphans = _intersect(wanted, owned)
            orphans = _subtract(orphans, self._held())
            if orphans:
                self._lock_all(orphans)
                self._owned[other] = _merge(self._owned[other] + orphans)
                kept += _total(orphans)
        return _total(owned) - kept

    def unpin_all(self) -> int:
        released = 0
        for key in list(self._owned):
            released += self.unpin(key)
        return released

    def __enter__(self) -> "Pinner":
        return self

    def __exit__(self, *exc) -> None:
        self.unpin_all()


def drop_page_cache(tensor: torch.Tensor) -> int:
    """Release the resident page cache under a file-mapped tensor; return the bytes released.

    For the original of a pin made as a copy: without this its pages stay cached
    until memory pressure reclaims them. Anonymous pages are not touched (there is
    no swap to page them out to). Measured with pagemap before and after.
    """
    start, end = page_span(tensor)
    before = classify_range(start, end).file_backed
    if _libc().madvise(start, end - start, _MADV_PAGEOUT) != 0:
        code = ctypes.get_errno()
        raise PinError(code, f"madvise(MADV_PAGEOUT) of {format_size(end - start)} failed: {os.strerror(code)} "
                             "(needs Linux 5.4 or later)")
    return max(0, before - classify_range(start, end).file_backed)
