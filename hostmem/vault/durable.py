"""Durable writes: a file is either whole under its final name, or not there.

Files are written to a temporary name in their final folder, fsynced, renamed, and
the folder fsynced (a rename is atomic; the folder fsync makes it durable), so a crash
at any instant never leaves a torn file under a name the cache serves.

A later start must tell a dead writer's leftovers from a live one's work, including a
writer in another pid namespace (a container sharing the root), where no pid means
anything. So liveness is a kernel fact: the writer holds an exclusive flock on its
temporary file from creating it until it is renamed into place, and the kernel drops
that lock when the writer dies, however it dies. A sweep removes a temporary file only
when it takes that lock without waiting (:func:`remove_if_abandoned`). The pid in the
name (``.tmp-<pid>-<random>``) is for people only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

from ..file_writes import DIRECT_ALIGN, start_writeback, write_all, write_cached, write_uncached, write_uncached_pieces
from .anchor import in_folder, lstat_in, open_folder, remove_tree_in, rename_in, unlink_in
from .safety import VaultError, read_trusted

__all__ = [
    "TMP_PREFIX",
    "fsync_dir",
    "write_all",
    "start_writeback",
    "write_cached",
    "write_uncached",
    "write_uncached_pieces",
    "DIRECT_ALIGN",
    "tmp_path_in",
    "open_tmp",
    "remove_if_abandoned",
    "seal",
    "discard",
    "durable_write",
    "free_bytes",
    "read_small",
    "remove_tree",
]

TMP_PREFIX = ".tmp-"


def fsync_dir(path: str) -> None:
    """fsync a cache folder so that a rename or unlink in it survives a crash; the folder
    opened from the root's descriptor, as every path of the cache is (:mod:`.anchor`)."""
    fd = open_folder(path)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path_in(folder: str, suffix: str = "") -> str:
    """A fresh temporary name in ``folder`` (same filesystem, so the rename is atomic)."""
    return os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}{suffix}")


def _same_file(fd: int, path: str, dir_fd: int | None = None) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        named = lstat_in(path, dir_fd)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def _folder_of(path: str, dir_fd: int | None):
    """``(descriptor of path's folder, path's last name)``: ``dir_fd`` where the caller holds
    the folder open (walked from the root's descriptor when it opened it), else the folder
    walked now (:func:`~.anchor.in_folder`)."""
    if dir_fd is not None:
        yield dir_fd, os.path.basename(path)
        return
    with in_folder(path) as found:
        yield found


def open_tmp(folder: str, suffix: str = "", dir_fd: int | None = None) -> tuple[int, str]:
    """Create a new 0600 temporary file in ``folder``, never through a symlink, and hold
    its writer's lock (see the module docstring) until :func:`seal` or ``os.close``.
    ``dir_fd``: ``folder``'s descriptor, where the caller holds it open (a build's
    session, for its many layers), instead of a walk from the root for each file.

    A sweep may take the lock in the instant between creating the file and locking it;
    it removes the file while holding the lock, so once ours is granted the name is
    checked to still be our file, and a new one is made if it is not.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        path = tmp_path_in(folder, suffix)
        with _folder_of(path, dir_fd) as (folder_fd, name):  # the folder walked from the root's descriptor
            fd = os.open(name, flags, 0o600, dir_fd=folder_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if _same_file(fd, path, folder_fd):
                    return fd, path
            except BaseException:
                os.close(fd)
                discard(path, dir_fd)
                raise
            os.close(fd)


def _open_to_probe(path: str) -> int:
    """Open a temporary file to take its lock: for writing where allowed (NFS grants an
    exclusive flock only on a file open for writing), else for reading."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with in_folder(path) as (folder_fd, name):
        if not stat.S_ISREG(os.stat(name, dir_fd=folder_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.EINVAL, f"{path}: not a regular file; left alone")  # a device is never opened
        try:
            return os.open(name, os.O_RDWR | flags, dir_fd=folder_fd)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
        return os.open(name, os.O_RDONLY | flags, dir_fd=folder_fd)


def remove_if_abandoned(path: str) -> bool:
    """Remove the temporary file ``path`` if no writer holds its lock; True if it went.

    The lock is taken without waiting and held while the file is unlinked, so a writer
    that just created it learns it lost the name (see :func:`open_tmp`). A file that is
    gone, not a regular file, or cannot be opened at all is left alone.
    """
    try:
        fd = _open_to_probe(path)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK): its writer is alive; or a filesystem without flock
        os.close(fd)
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or not _same_file(fd, path):
            return False
        unlink_in(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def seal(fd: int, tmp: str, final: str, sync_dir: bool = True, dir_fd: int | None = None) -> None:
    """fsync, rename into place, close and fsync the folder: the file is now durable.

    The rename comes before the close, so the writer's lock covers the temporary name
    for as long as it exists. ``sync_dir=False`` leaves the folder's fsync to a later
    seal in the same folder (the manifest's): the file's data is on disk before its
    name, so a crash in between can lose the name, never serve a torn file. On any
    failure the temporary file is removed, so nothing partial stays behind. ``dir_fd``:
    the folder of both names, held open by the caller (see :func:`open_tmp`).
    """
    try:
        os.fsync(fd)
        if dir_fd is not None and os.path.dirname(tmp) == os.path.dirname(final):
            os.rename(os.path.basename(tmp), os.path.basename(final), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        else:
            rename_in(tmp, final)  # both names in their folders' descriptors: no link on the way followed
    except BaseException:
        discard(tmp, dir_fd)
        os.close(fd)
        raise
    os.close(fd)
    if sync_dir:
        fsync_dir(os.path.dirname(final))


def discard(path: str, dir_fd: int | None = None) -> None:
    """Remove a file if it is there (cleanup must not raise over the real error); relative
    to ``dir_fd``, its folder's descriptor, where the caller holds one."""
    try:
        if dir_fd is not None:
            os.unlink(os.path.basename(path), dir_fd=dir_fd)
        else:
            unlink_in(path)
    except (OSError, VaultError):
        pass


def durable_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (small files: the manifest)."""
    fd, tmp = open_tmp(os.path.dirname(path))
    try:
        write_all(fd, data, 0)
    except BaseException:
        os.close(fd)
        discard(tmp)
        raise
    seal(fd, tmp, path)


def read_small(path: str) -> bytes:
    """The bytes of a small file of the cache (a memo, a record): a regular file of this
    user's, writable by nobody else, never read through a link
    (:func:`~hostmem.vault.safety.read_trusted`)."""
    return read_trusted(path)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def remove_tree(path: str) -> None:
    """Remove a cache folder from its folder's descriptor, walked from the root's: links
    inside are unlinked, never followed, and nothing on the way to it is a link
    (:func:`~hostmem.vault.anchor.remove_tree_in`)."""
    remove_tree_in(path)
