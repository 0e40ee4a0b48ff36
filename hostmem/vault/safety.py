"""Where the vault may live: a root of our own, private folders, no links followed.

A cache folder others can write into, or one another user owns, is a door for
replacing the model weights we serve; so roots and folders are refused the way sshd's
StrictModes refuses a home folder: owned by this user (or root), and writable by nobody
else (a sticky bit does not help: it stops others removing our entries, not planting
their own under the names we will look up). The one exception is the parent of a root
(a shared folder such as ``/tmp``), which is not checked; the root itself, every folder
and every file the cache reads are. Files are opened without following links, and a
special file (a FIFO, a device) is refused before it is opened. A root on tmpfs is
refused too: its pages are shared memory the kernel cannot drop without swap, so
mapping merged weights from there would save no host memory at all.
"""

from __future__ import annotations

import errno
import os
import stat

from hostmem.procfs import SHMEM_FS_TYPES, filesystem_of

from .anchor import anchor_root, in_folder, mkdir_in, open_in
from .checks import (VaultError, check_file_safe, check_folder_private, check_folder_safe, check_not_symlink,
                     check_owned)

__all__ = [
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


def check_not_tmpfs(path: str) -> None:
    """Refuse a cache folder on tmpfs: its pages cannot be reclaimed without swap."""
    mount = filesystem_of(nearest_existing(path))
    if mount is not None and mount.fs_type in SHMEM_FS_TYPES:
        raise VaultError(
            f"{path}: on {mount.fs_type} (mounted at {mount.mount_point}); pages there are shared "
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


def read_trusted(path: str, limit: int = 64 * 1024 * 1024, dir_fd: int | None = None) -> bytes:
    """The bytes of a small file of the cache (a manifest, a memo, a record), opened with
    :func:`open_trusted`; one larger than ``limit`` is refused, not read into memory."""
    fd = open_trusted(path, dir_fd=dir_fd)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise VaultError(f"{path}: {size} bytes, more than a file of the cache ever holds; remove it")
        return handle.read(limit + 1)


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


def make_private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing, in its folder opened from the root's descriptor
    (:mod:`.anchor`); an existing one must pass :func:`check_folder_safe`."""
    try:
        mkdir_in(path)
        with in_folder(path) as (parent, _):
            os.fsync(parent)  # the new folder's entry survives a crash too
    except FileExistsError:
        pass
    except VaultError:
        raise
    except OSError as exc:
        raise _cannot_create(path, exc) from None
    check_folder_safe(path)


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


def _create_root(root: str) -> None:
    try:  # a file where a parent folder should be, /proc, a read-only disk...
        os.makedirs(os.path.dirname(root), exist_ok=True)
    except OSError as exc:
        raise _cannot_create(root, exc) from None
    try:
        os.mkdir(root, 0o700)
        os.chmod(root, 0o700)
    except FileExistsError:
        pass  # a file in the way of the root itself is refused below
    except OSError as exc:
        raise _cannot_create(root, exc) from None


def _check_root_link(root: str) -> None:
    """A root may be a link to a disk of the user's, but only a link of the user's own:
    another user who made the name first (in a shared parent such as ``/tmp``) would
    point the cache wherever they like."""
    try:
        st = os.lstat(root)
    except OSError:  # missing, or under a file: creating it says what is in the way
        return
    if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.geteuid(), 0):
        raise VaultError(
            f"{root}: a link made by uid {st.st_uid}, not by this user (uid {os.geteuid()}), so it may point "
            "anywhere. Remove it (`rm` it, or ask its owner) or choose a cache root of your own "
            "(--root DIR, lora.cache.roots or HOSTMEM_CACHE_ROOT)."
        )


def check_root(root: str) -> None:
    """An existing root: a folder (or a link of this user's to one), owned by this user or
    root, writable by nobody else. ``FileNotFoundError`` when there is none. Every path
    below it is walked from its descriptor from then on (:func:`~.anchor.anchor_root`)."""
    os.lstat(root)
    _check_root_link(root)
    if not os.path.isdir(root):
        raise VaultError(f"{root}: exists and is not a folder; choose another cache root.")
    st = os.stat(root)
    check_owned(root, st)
    check_folder_private(root, st)
    anchor_root(os.path.abspath(root))


def prepare_root(root: str | os.PathLike, create: bool = True) -> str:
    """Return the absolute root, created 0700 if missing (with ``create``), after the
    safety checks: a folder (the root itself may be a link to a disk, a link of this
    user's), owned by this user or root, writable by nobody else, not on tmpfs."""
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    check_not_tmpfs(root)
    _check_root_link(root)
    if not os.path.isdir(root):
        if not create:
            return root  # a read-only root that holds nothing: nothing to check, nothing to serve
        _create_root(root)
    check_root(root)
    check_not_tmpfs(root)
    return root
