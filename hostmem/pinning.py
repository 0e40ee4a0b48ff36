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
import weakref

import torch

from .errors import HostmemError
from .page_spans import intersect_spans as _intersect
from .page_spans import merge_spans as _merge
from .page_spans import page_span
from .page_spans import spans_of as _spans
from .page_spans import subtract_spans as _subtract
from .page_spans import total_of as _total
from .procfs import read_status
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
    "replaced",
    "page_bytes",
]

_MADV_PAGEOUT = 21
_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


class PinError(HostmemError, OSError):
    """A pin or unpin failed; the message says why and what to do."""


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
    splits = True  # any page range may be unlocked, whatever range locked it

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
    splits = False  # a registration is undone whole, from the address it was made at

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


def page_bytes(tensors) -> int:
    """Bytes of the whole pages under ``tensors``' storages, each page once: what locking
    them all adds to VmLck."""
    return _total(_spans(t for t in tensors if t.device.type == "cpu"))


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


_LIVE: "weakref.WeakSet[Pinner]" = weakref.WeakSet()  # the registry replaced() asks


def replaced(old: torch.Tensor | None, new: torch.Tensor | None) -> None:
    """``new`` now stands where ``old`` stood (a merge, a switch, an unmerge, a remap).

    Whatever replaces a model's tensor calls this, while it still holds ``old``, so that
    a pin follows its weight: every live :class:`Pinner` that pinned ``old``'s storage
    pins ``new`` in its place (where its policy and budget allow) or releases the key,
    and no page stays locked for a tensor nothing serves. Costs nothing without pins.
    """
    if old is None or old is new or not _LIVE or old.device.type != "cpu":
        return
    for pinner in list(_LIVE):
        pinner.follow(old, new)


def _unlock_owned(backend, owned: dict) -> None:
    """Unlock every span in ``owned`` (a collected :class:`Pinner`'s books)."""
    for spans in owned.values():
        for start, end in spans:
            try:
                backend.unlock(start, end - start)
            except PinError:
                pass  # nothing left to do at collection: the process keeps what it cannot unlock
    owned.clear()


class Pinner:
    """Pins named groups of CPU tensors in place and knows exactly which pages it locked.

    ``pin(key, tensors)`` locks the pages under the tensors' storages that no other
    key holds yet; ``unpin(key)`` releases the pages it locked and locks again, for
    their owners, pages that other keys still need. Use as a context manager to
    unpin everything on exit.

    It holds the tensors it pinned (their pages must stay mapped while locked) and
    follows them: when a replacer reports one replaced (:func:`replaced`), the key is
    moved to the replacement (:meth:`repin`) if ``wants(key)`` and the pages locked
    stay within ``max_locked``; otherwise the key is released and listed in
    ``released``. Either way the books, VmLck and a ledger agree afterwards.
    """

    def __init__(self, backend=None, *, max_locked: int | None = None, wants=None):
        self.backend = backend if backend is not None else default_backend()
        self.max_locked, self.wants = max_locked, wants
        self.released: list = []  # keys let go because a replacement could not be pinned
        self._wanted: dict = {}
        self._owned: dict = {}
        self._tensors: dict = {}
        self._by_storage: dict[tuple[int, int], set] = {}  # storage -> the keys holding a tensor of it
        _LIVE.add(self)
        # dropped without unpin_all (a server's pins object let go): unlock while the pages it
        # holds are still mapped, or freed heap pages would stay locked under later allocations
        weakref.finalize(self, _unlock_owned, self.backend, self._owned)

    @property
    def locked_bytes(self) -> int:
        """Bytes of whole pages locked by this pinner."""
        return sum(_total(spans) for spans in self._owned.values())

    def keys(self) -> list:
        return list(self._owned)

    def spans(self, keys=None) -> list[tuple[int, int]]:
        """The ``(start, end)`` page spans this pinner locked for ``keys`` (default: all), in
        address order; spans of two keys never overlap."""
        chosen = self._owned if keys is None else {key: self._owned[key] for key in keys}
        return sorted(span for spans in chosen.values() for span in spans)

    def tensors(self, key) -> list[torch.Tensor]:
        return list(self._tensors[key])

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

    def _held(self, but=None) -> list[tuple[int, int]]:
        return [s for key, spans in self._owned.items() if key != but for s in spans]

    def would_lock(self, tensors) -> int:
        """Bytes that pinning ``tensors`` would newly lock (whole pages not held yet)."""
        return _total(_subtract(_spans(tensors), self._held()))

    @staticmethod
    def _check_cpu(key, tensors) -> None:
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"{key!r}: a tensor on {t.device} has no host pages to pin")

    def pin(self, key, tensors) -> int:
        """Lock the pages under ``tensors``; return the bytes newly locked."""
        if key in self._owned:
            raise ValueError(f"{key!r} is already pinned")
        self._check_cpu(key, tensors)
        wanted = _spans(tensors)
        new = _subtract(wanted, self._held())
        self._lock_all(new)
        self._wanted[key], self._owned[key] = wanted, new
        self._hold(key, tensors)
        return _total(new)

    def _hand_over(self, spans) -> int:
        """Give ``spans`` (locked, no longer their owner's) to the other keys that want them;
        unlock the rest. Returns the bytes kept locked."""
        kept = []
        for other, wanted in self._wanted.items():
            orphans = _subtract(_intersect(wanted, spans), self._held() + kept)
            if orphans:
                self._owned[other] = sorted(self._owned[other] + orphans)  # as locked: a registration is undone whole
                kept += orphans
        if getattr(self.backend, "splits", True):
            for start, end in _subtract(spans, kept):
                self.backend.unlock(start, end - start)
        else:  # undo each registration whole, then register again what the others keep
            for start, end in spans:
                self.backend.unlock(start, end - start)
            self._lock_all(kept)
        return _total(kept)

    def _hold(self, key, tensors) -> None:
        """Keep ``tensors`` (alive, and indexed by storage) as ``key``'s; none: forget the key."""
        for t in self._tensors.pop(key, []):
            keys = self._by_storage.get(_storage_key(t))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_storage[_storage_key(t)]
        if tensors:
            self._tensors[key] = list(tensors)
            for t in tensors:
                self._by_storage.setdefault(_storage_key(t), set()).add(key)

    def unpin(self, key) -> int:
        """Release ``key``'s pages that no other key needs; return the bytes released."""
        owned = self._owned.pop(key)
        self._wanted.pop(key)
        self._hold(key, [])
        return _total(owned) - self._hand_over(owned)

    def repin(self, key, tensors) -> int:
        """Move ``key``'s pins to ``tensors``: lock their pages not held yet, then release
        the pages only ``key`` held and no longer needs. Returns the change in bytes locked."""
        self._check_cpu(key, tensors)
        before = self.locked_bytes
        if not getattr(self.backend, "splits", True):  # no partial undo: move the key whole
            self.unpin(key)
            self.pin(key, tensors)
            return self.locked_bytes - before
        wanted = _spans(tensors)
        new = _subtract(wanted, self._held())
        self._lock_all(new)
        old = self._owned[key]
        self._owned[key] = _merge(_intersect(old, wanted) + new)
        self._wanted[key] = wanted
        self._hold(key, tensors)
        self._hand_over(_subtract(old, wanted))
        return self.locked_bytes - before

    def follow(self, old: torch.Tensor, new: torch.Tensor | None) -> None:
        """``new`` replaced ``old``: move every key holding ``old`` to ``new``, or release it."""
        storage = _storage_key(old)
        holders = list(self._by_storage.get(storage, ()))
        if not holders:
            return
        same = (lambda t: t is old) if any(t is old for k in holders for t in self._tensors[k]) \
            else (lambda t: _storage_key(t) == storage)  # a wrapper of old's bytes stood for it
        for key in [k for k in holders if any(same(t) for t in self._tensors[k])]:
            tensors = [t for t in self._tensors[key] if not same(t)]
            tensors += [new] if new is not None and new.device.type == "cpu" else []
            if tensors and self._may_follow(key, tensors):
                self.repin(key, tensors)
            else:
                self.unpin(key)
                self.released.append(key)

    def _may_follow(self, key, tensors) -> bool:
        if self.wants is not None and not self.wants(key):
            return False
        if self.max_locked is None:
            return True
        old = self._owned[key]
        wanted = _spans(tensors)
        freed = _subtract(_subtract(old, wanted), [s for k, w in self._wanted.items() if k != key for s in w])
        after = self.locked_bytes + _total(_subtract(wanted, self._held())) - _total(freed)
        return after <= self.max_locked

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
