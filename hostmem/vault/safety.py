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

from ..errors import HostmemError
from hostmem.procfs import SHMEM_FS_TYPES, filesystem_of

from ..file_writes import fsync_dir

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


class VaultError(HostmemError, ValueError):
    """The cache cannot be used as configured; the message names the path and the fix.

    A ``ValueError`` so that the command line prints it as one actionable line.
    """


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


def _writable_by_others(path: str, st: os.stat_result, what: str) -> VaultError:
    """The refusal of a folder or file others can write; its advice gives a safe mode
    (``chmod +t`` would not: a sticky folder still takes others' new entries)."""
    who = "every user" if st.st_mode & stat.S_IWOTH else "its group"
    return VaultError(
        f"{path}: {what} writable by {who} (mode {stat.S_IMODE(st.st_mode):04o}), so another user could plant "
        f"or swap cached weights. Run `chmod go-w {path}` (the cache makes its folders 0700 and its files "
        "0600), or choose another cache root."
    )


def check_folder_private(path: str, st: os.stat_result | None = None) -> None:
    """Refuse a folder that anyone but its owner may write into, sticky or not.

    Anyone who can create entries there could plant a layer file, a manifest or a memo
    under the name we will look up, or rename a combination onto another's key.
    """
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        check_not_symlink(path, st)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _writable_by_others(path, st, "a cache folder")


def check_file_safe(path: str, st: os.stat_result) -> None:
    """A file the cache trusts (a manifest, a memo, a record, a lock): a regular file, ours
    (or root's), and writable by nobody else."""
    if not stat.S_ISREG(st.st_mode):
        kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "a folder" if stat.S_ISDIR(st.st_mode) else "a socket or other special file")
        raise VaultError(f"{path}: is {kind}, where the cache keeps a regular file of its own; the cache never "
                         "reads through it. Remove it (`rm` it) and start again.")
    check_owned(path, st, "file")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _writable_by_others(path, st, "a cache file")


def open_trusted(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """Open a file of the cache without following a link, a special file refused before it
    is opened (a FIFO would hang the open, a device would be read without end), and the
    file opened checked with :func:`check_file_safe`. ``FileNotFoundError`` passes (with
    ``O_CREAT`` in ``flags`` a missing file is created ``mode``)."""
    try:
        check_file_safe(path, os.lstat(path))
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    try:
        check_file_safe(path, os.fstat(fd))  # the very file opened: not one swapped in since the lstat
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_trusted(path: str, limit: int = 64 * 1024 * 1024) -> bytes:
    """The bytes of a small file of the cache (a manifest, a memo, a record), opened with
    :func:`open_trusted`; one larger than ``limit`` is refused, not read into memory."""
    fd = open_trusted(path)
    with os.fdopen(fd, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise VaultError(f"{path}: {size} bytes, more than a file of the cache ever holds; remove it")
        return handle.read(limit + 1)


def check_not_symlink(path: str, st: os.stat_result | None = None) -> os.stat_result:
    """Return ``lstat(path)``; refuse a symlink where the cache expects its own file."""
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        raise VaultError(
            f"{path}: is a symlink; the cache never follows links inside itself. Remove the link "
            "(`hostmem cache rm KEY` or `rm` it) and start again."
        )
    return st


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


def check_owned(path: str, st: os.stat_result, what: str = "folder") -> None:
    """Refuse a folder or file another user owns (root's are accepted, as sshd's StrictModes
    does): its owner could replace cached weights, even when its mode looks private to us."""
    if st.st_uid not in (os.geteuid(), 0):
        raise VaultError(
            f"{path}: owned by uid {st.st_uid} (a {what} of the cache), not by this user (uid {os.geteuid()}), "
            f"who could replace cached weights. `chown {os.geteuid()} {path}` if it is yours, or choose a cache root of your own "
            "(--root DIR, lora.cache.roots or HOSTMEM_CACHE_ROOT)."
        )


def check_folder_safe(path: str) -> os.stat_result:
    """A cache folder that is there must be a real folder (no link), ours, and private."""
    st = check_not_symlink(path)
    if not stat.S_ISDIR(st.st_mode):
        raise VaultError(f"{path}: exists and is not a folder; move it away or choose another cache root.")
    check_owned(path, st)
    check_folder_private(path, st)
    return st


def make_private_dir(path: str) -> None:
    """Create ``path`` 0700 if missing; an existing one must pass :func:`check_folder_safe`."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # the umask may have narrowed it; never widened, but be exact
        fsync_dir(os.path.dirname(path))  # the new folder's entry survives a crash too
    except FileExistsError:
        pass
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
    root, writable by nobody else. ``FileNotFoundError`` when there is none."""
    os.lstat(root)
    _check_root_link(root)
    if not os.path.isdir(root):
        raise VaultError(f"{root}: exists and is not a folder; choose another cache root.")
    st = os.stat(root)
    check_owned(root, st)
    check_folder_private(root, st)


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
