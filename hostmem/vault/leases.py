"""A combination stays in use for as long as any weight served from it lives.

A session's exclusive lock (``<key>.lock``) covers building and adopting and is
released when the session closes; the model then goes on serving read-only views of
the layer files for as long as the process runs. Evicting the combination then would
free no disk (a mapped file's inode lives until it is unmapped) while counting it
freed, so the views hold the combination in use themselves:

- every layer the vault hands out is a view of a :class:`_LeasedMapping`, a read-only
  mapping that references its key's :class:`UseLease`; torch keeps a mapping alive
  for as long as any tensor over its storage lives (the installed parameter, a view
  of it, a copy of the reference anywhere);
- the lease holds a shared flock on ``<key>.use``; one lease per key and process,
  taken by the session while it holds the key's exclusive lock, so nobody can remove
  the file in between;
- when the last view goes (``lora_cache.unmerge``, the model dropped, the process
  gone), the lease's descriptor closes and the kernel releases the flock.

Eviction, ``prune`` and ``hostmem cache rm`` ask for ``<key>.use`` exclusively without
waiting (after ``<key>.lock``) and leave the combination alone when they cannot have it.

So a process of ours holds ``<key>.use`` exclusively only for an instant. Another user
who can read the file (a root made readable by others) can hold it for ever: a lease is
waited for a bounded time (:func:`~.locks.lock_wait_s`, short), then the weights are
served without it, saying who holds it. That is safe: the lease only keeps our own
eviction from counting as freed a combination still mapped, and while the other user
holds the file exclusively no eviction of ours can take it either; the files are ours
and private, so nobody else can change what is mapped.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import warnings
import weakref

import torch

from hostmem.safetensors.mapping import SafetensorsError, SafetensorsHeader, advise_huge_pages
from hostmem.safetensors.writers import guard_foreign_writers

from .layer_file import LayerEntry, header_of_open_file, known_layout, view_matches
from .locks import KeyLock, describe_holders, lock_holders, lock_wait_s, say
from .safety import check_file_safe, check_not_symlink, open_trusted

__all__ = ["UseLease", "use_lease", "lease_alive", "map_layer", "map_open_layer", "map_recorded",
           "remove_use_file_if_unused"]

# Errors of mapping a layer that are the file's own (gone, a link, unreadable, a bad block);
# any other (EMFILE, ENOMEM, ...) is the process's, and passes.
_FILE_ERRNOS = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.EIO, errno.EACCES,
                          errno.EPERM})

_LEASES: "weakref.WeakValueDictionary[str, UseLease]" = weakref.WeakValueDictionary()
_LEASES_LOCK = threading.Lock()


class UseLease:
    """A shared flock on a key's ``.use`` file, released when the last reference goes;
    ``held`` False where another process held the file exclusively past the bounded
    wait (see the module's docstring)."""

    def __init__(self, path: str):
        self.path = path
        if os.path.lexists(path):
            check_not_symlink(path)
        self._lock = KeyLock(path)
        bound = lock_wait_s(short=True)  # only a momentary probe of ours holds it exclusively
        self.held = self._lock.acquire_within(bound, exclusive=False)
        if not self.held:
            say(f"use lock {path} is held by {describe_holders(lock_holders(path))} past {bound:.0f} s; serving "
                "without it (the files are this user's own and private; until it is let go, no eviction of this "
                "cache removes them)")
        weakref.finalize(self, self._lock.release)

    def __repr__(self) -> str:
        return f"UseLease({self.path!r})"


def use_lease(path: str) -> UseLease:
    """This process's lease on ``path``: the live one, or a new one.

    Take it only while holding the key's exclusive lock: removers take that lock first,
    so the ``.use`` file cannot be removed under a lease being taken.
    """
    with _LEASES_LOCK:
        lease = _LEASES.get(path)
        if lease is None:
            lease = UseLease(path)
            _LEASES[path] = lease
        return lease


def lease_alive(path: str) -> bool:
    """True while some view (or session) of this process still holds the lease on ``path``."""
    with _LEASES_LOCK:
        return _LEASES.get(path) is not None


def remove_use_file_if_unused(path: str) -> None:
    """Remove the use file ``path`` where no view holds its lease: none of this process's,
    none of another's. Only while holding its key's lock (nobody is taking a lease then)."""
    if lease_alive(path):
        return  # views of this process live on
    probe = KeyLock(path)
    if os.path.lexists(path) and probe.acquire(blocking=False):  # no other process's views either
        probe.release(remove=True)


class _LeasedMapping(mmap.mmap):
    """A ``PROT_READ``/``MAP_SHARED`` mapping that keeps its key's lease while it lives."""

    lease: UseLease | None = None


def _open_layer(path: str, dir_fd: int | None) -> tuple[int, os.stat_result]:
    """Open layer file ``path`` relative to its folder's descriptor (``dir_fd``, else the
    folder walked from the root's), no link followed, never hanging on a FIFO; the
    descriptor checked as every file of the cache is (a regular file, ours, private)."""
    if dir_fd is None:
        fd = open_trusted(path)
        return fd, os.fstat(fd)
    name = os.path.basename(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link where the layer's file should be: refused by name
            check_not_symlink(path, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
        raise
    try:
        st = os.fstat(fd)
        check_file_safe(path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def map_layer(path: str, name: str, lease: UseLease, entry: LayerEntry | None = None,
              dir_fd: int | None = None) -> tuple[torch.Tensor, SafetensorsHeader | None]:
    """Map tensor ``name`` of layer file ``path`` read-only; the view holds ``lease``.

    The file is opened relative to ``dir_fd`` (its key folder's descriptor, which the
    session opened from the root's) without following a link, checked on its
    descriptor, and that very descriptor is mapped. Returns the view and the header it
    was read with (the caller checks it against what it recorded), or None for the
    header where ``entry`` (the layer's record) says where the data starts and the open
    file still has the stamp it had when its bytes last matched their checksum
    (:func:`~hostmem.vault.layer_file.known_layout`): then no header is read. A write
    into the view faults instead of copying the page.
    """
    fd, st = _open_layer(path, dir_fd)
    try:
        offset = None if entry is None else known_layout(st, entry)
        if offset is None:
            header = header_of_open_file(fd, path)
            if name not in header.tensors:
                raise SafetensorsError(f"{path}: no tensor named {name!r}")
            info = header.tensors[name]
            offset, nbytes, dtype, shape = header.data_offset + info.begin, info.nbytes, info.torch_dtype, info.shape
        else:
            header, nbytes, dtype, shape = None, entry.data_bytes, entry.torch_dtype, entry.shape
        return _map_open(fd, lease, offset, nbytes, dtype, shape), header
    finally:
        os.close(fd)


def map_recorded(folder: str, entry: LayerEntry, lease: UseLease, folder_fd) -> tuple[torch.Tensor | None, str, bool]:
    """Map a sealed layer read-only (:func:`map_layer`, opened in ``folder_fd``, its key
    folder's :class:`~.anchor.FolderFd`), if it still is what ``entry`` recorded: ``(view,
    "", False)``, else ``(None, why, passing)``; ``passing``: the map failed for the
    process's sake (out of descriptors or address space), nothing wrong with the file."""
    path = os.path.join(folder, entry.file)
    try:  # opened in the key folder's descriptor, kept for the session: one openat per layer
        view, header = folder_fd.run(lambda fd: map_layer(path, entry.name, lease, entry, fd))
    except (SafetensorsError, OSError) as exc:
        return None, str(exc), isinstance(exc, OSError) and exc.errno not in _FILE_ERRNOS
    if header is None:
        return view, "", False  # unchanged since it was verified: mapped at its recorded offset, no header read
    if header.file_size != entry.size or header.header_sha256 != entry.header_sha256:
        return None, f"{path}: size or header changed since it was sealed", False
    if not view_matches(view, entry):  # changed since it was checked at open: its bytes are read
        return None, f"{path}: content changed since it was verified", False
    return view, "", False


def map_open_layer(fd: int, lease: UseLease, entry: LayerEntry) -> torch.Tensor:
    """Map the data of the layer file open as ``fd`` (its writer's descriptor: the file this
    process wrote and has not named yet) read-only, at the offset ``entry`` records; the
    view holds ``lease``. The mapping outlives the descriptor and the rename that follows."""
    return _map_open(fd, lease, entry.data_offset, entry.data_bytes, entry.torch_dtype, entry.shape)


def _map_open(fd: int, lease: UseLease, offset: int, nbytes: int, dtype, shape) -> torch.Tensor:
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    mapping = _LeasedMapping(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    advise_huge_pages(mapping)
    guard_foreign_writers()  # a read-only weight is handed out: writers get an error, not a bare SIGSEGV
    mapping.lease = lease
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # not writable: that is the point
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).reshape(shape)
