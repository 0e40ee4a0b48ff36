"""Where the vault may live: a root of our own, private folders, no links followed.

A cache folder others can write into, or one another user owns, is a door for
replacing the model weights we serve; so roots and folders are refused the way sshd's
StrictModes refuses a home folder: owned by this user (or root), and writable by nobody
else (a sticky bit does not help: it stops others removing our entries, not planting
their own under the names we will look up). The folders above a root are walked from
``/`` and trusted as sshd trusts the path to a home (:mod:`.path_walk`: root's or ours,
writable by nobody else unless sticky, no link of another user's), and the root's
identity kept (:mod:`.anchor`); the root itself, every folder and every file the cache
reads are ours and private. Files are opened without following links, and a
special file (a FIFO, a device) is refused before it is opened. A root on tmpfs is
refused too: its pages are shared memory the kernel cannot drop without swap, so
mapping merged weights from there would save no host memory at all.
"""

from __future__ import annotations

import errno
import os

from hostmem.procfs import SHMEM_FS_TYPES

from . import checks
from .anchor import anchor_root, in_folder, lstat_in, mkdir_in, open_folder, open_in
from .checks import VaultError, check_file_safe, check_folder_private, check_not_symlink, check_owned
from .path_walk import walk_to

__all__ = [
    "parse_json",
    "VaultError",
    "nearest_existing",
    "prepare_root",
    "check_not_tmpfs",
    "check_not_symlink",
    "check_folder_private",
    "make_private_dir",
    "check_owned",
    "check_folder_safe",
    "check_root",
    "check_path",
    "check_file_safe",
    "open_trusted",
    "read_trusted",
    "root_is_read_only",
]


def nearest_existing(path: str) -> str:
    """Return ``path`` or its closest existing ancestor (to learn its filesystem)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _mount_of_device(st_dev: int) -> tuple[str, str] | None:
    """``(filesystem type, mount point)`` of the filesystem of device ``st_dev``, from
    ``/proc/self/mountinfo``'s ``major:minor``: no path resolved, so nothing renamed
    meanwhile can make it fail or answer for another folder."""
    device = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open("/proc/self/mountinfo") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) >= 5 and kind and fields[2] == device:
            return kind[0], fields[4]
    return None


def check_not_tmpfs(path: str, st: os.stat_result | None = None) -> None:
    """Refuse a cache folder on tmpfs: its pages cannot be reclaimed without swap. ``st``:
    the folder's ``fstat`` (else its nearest existing folder's, by path)."""
    if st is None:
        try:
            st = os.stat(nearest_existing(path))
        except OSError:
            return  # gone meanwhile: the walk that opens it says what is in the way
    mount = _mount_of_device(st.st_dev)
    if mount is not None and mount[0] in SHMEM_FS_TYPES:
        raise VaultError(
            f"{path}: on {mount[0]} (mounted at {mount[1]}); pages there are shared "
            "memory the kernel cannot drop without swap, so a merge cache there saves no host "
            "memory. Choose a folder on a disk-backed filesystem (--root DIR or HOSTMEM_CACHE_ROOT, "
            "e.g. ~/.cache/hostmem)."
        )


def open_trusted(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """Open a file of the cache relative to its folder's descriptor (``dir_fd``, else the
    folder walked from its root's descriptor, :mod:`.anchor`), without following a link,
    a special file refused before it is opened (a FIFO would hang the open, a device
    would be read without end), and the file opened checked with :func:`check_file_safe`.
    ``FileNotFoundError`` passes (with ``O_CREAT`` in ``flags`` a missing file is
    created ``mode``)."""
    return open_in(path, flags, mode, dir_fd)


def parse_json(data: bytes | str):
    """``json.loads``, where nesting too deep for the parser (a damaged or planted file) is a
    ``JSONDecodeError`` as any other broken JSON, never a ``RecursionError`` that stops a start."""
    import json

    try:
        return json.loads(data)
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None


def read_trusted(path: str, limit: int = 64 * 1024 * 1024, dir_fd: int | None = None) -> bytes:
    """The bytes of a small file of the cache (a manifest, a memo, a record), opened with
    :func:`open_trusted`; one larger than ``limit`` is refused, not read into memory."""
    fd = open_trusted(path, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise VaultError(f"{path}: {size} bytes, more than a file of the cache ever holds; remove it")
        data = handle.read(size + 1)  # its size, not the limit: a read asks the allocator for what it may read
        return data + handle.read(limit + 1 - len(data)) if len(data) > size else data  # grown meanwhile


def _cannot_create(path: str, exc: OSError) -> VaultError:
    """Say why ``path`` cannot be made a cache folder, naming the part of it that is in the way."""
    blocker = nearest_existing(os.path.dirname(path))
    if os.path.lexists(blocker) and not os.path.isdir(blocker):
        why = f"{blocker} is a file, not a folder"
    elif exc.errno == errno.ENOENT:  # the folder exists but its filesystem makes no new entries (/proc, /sys)
        why = f"{blocker} does not accept new folders ({exc.strerror})"
    else:
        why = f"{exc.strerror or exc} (creating it under {blocker})"
    return VaultError(
        f"{path}: cannot create the LoRA merge cache folder: {why}. Choose a cache root on a writable, "
        "disk-backed filesystem (--root DIR, lora.cache.root or HOSTMEM_CACHE_ROOT, e.g. ~/.cache/hostmem)."
    )


def check_folder_safe(path: str) -> os.stat_result:
    """A cache folder that is there must be a real folder (no link), ours, and private:
    its ``lstat`` taken in its parent's descriptor, walked from the root's (:mod:`.anchor`),
    so no folder on the way is a link."""
    return checks.check_folder_safe(path, lstat_in(path))


def _vanished(path: str) -> VaultError:
    return VaultError(f"{path}: removed or replaced while the cache was making it (another process is removing "
                      "this cache, or a folder on the way was swapped); start again.")


def make_private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing, in its folder opened from the root's descriptor
    (:mod:`.anchor`); an existing one must pass :func:`check_folder_safe`, checked on
    its descriptor walked from the root's. A folder on the way removed meanwhile is a
    :class:`VaultError` saying so."""
    try:
        mkdir_in(path)
        with in_folder(path) as (parent, _):
            os.fsync(parent)  # the new folder's entry survives a crash too
    except FileExistsError:
        pass
    except VaultError:
        raise
    except FileNotFoundError as exc:  # its folder gone meanwhile; or there, on a filesystem that makes none (/proc)
        raise (_cannot_create(path, exc) if os.path.isdir(os.path.dirname(path)) else _vanished(path)) from None
    except OSError as exc:
        raise _cannot_create(path, exc) from None
    try:
        os.close(open_folder(path))  # every folder on the way and this one, checked on its descriptor
    except FileNotFoundError:
        raise _vanished(path) from None


def root_is_read_only(root: str | os.PathLike) -> bool:
    """True when nothing can be written under ``root``: its filesystem (or that of its
    nearest existing parent) is mounted read-only, or this user may not write there."""
    path = nearest_existing(os.path.abspath(os.path.expanduser(os.fspath(root))))
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        return False
    return os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK)


def _open_checked_root(root: str, create: bool) -> int:
    """The root's descriptor, opened by a walk from ``/`` that trusts every folder and
    link on the way (:func:`~.path_walk.walk_to`), the root itself checked on it: a
    folder, ours or root's, writable by nobody else."""
    try:
        fd = walk_to(root, create)
    except OSError as exc:  # a file where a folder should be, /proc, a read-only disk...
        if isinstance(exc, FileNotFoundError) and not create:
            raise
        if not create:
            raise VaultError(f"{root}: cannot be opened as a cache root ({exc.strerror or exc}); choose "
                             "another cache root (--root DIR, lora.cache.roots or HOSTMEM_CACHE_ROOT).") from None
        raise _cannot_create(root, exc) from None
    try:
        st = os.fstat(fd)
        check_owned(root, st)
        check_folder_private(root, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_root(root: str) -> None:
    """An existing root: a folder (or a link of this user's or root's to one) whose every
    folder from ``/`` down is trusted (:mod:`.path_walk`), owned by this user or root,
    writable by nobody else. ``FileNotFoundError`` when there is none. Every path below
    it is walked from its descriptor from then on, the folder's identity kept
    (:func:`~.anchor.anchor_root`)."""
    root = os.path.abspath(root)
    fd = _open_checked_root(root, create=False)
    try:
        anchor_root(root, os.fstat(fd))
    finally:
        os.close(fd)


def check_path(root: str) -> None:
    """Check, creating nothing, the folders from ``/`` to ``root`` or its nearest existing
    folder as :func:`prepare_root` would (a plan's warning); :class:`VaultError` says why not."""
    root = os.path.abspath(root)
    found = nearest_existing(root)
    try:
        fd = walk_to(found) if found != root else _open_checked_root(root, create=False)
    except OSError:
        return  # gone meanwhile, or not a folder: the plan's own checks say so
    os.close(fd)


def prepare_root(root: str | os.PathLike, create: bool = True) -> str:
    """Return the absolute root, created 0700 if missing (with ``create``), after the
    safety checks: every folder from ``/`` to it trusted (the root itself may be a link
    to a disk, a link of this user's or root's), owned by this user or root, writable by
    nobody else, not on tmpfs. Its identity is kept (:func:`~.anchor.anchor_root`)."""
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    check_not_tmpfs(root)  # before anything is created there
    try:
        fd = _open_checked_root(root, create)
    except FileNotFoundError:
        return root  # (not created) a read-only root that holds nothing: nothing to check, nothing to serve
    try:
        st = os.fstat(fd)
        check_not_tmpfs(root, st)
        anchor_root(root, st)
    finally:
        os.close(fd)
    return root
