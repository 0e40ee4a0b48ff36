"""Every path of the cache resolved from its root's descriptor, one folder at a time.

Checking a folder's owner and mode by its path, then opening a file below it by the
same path, leaves a gap: between the check and the open, anyone who can write a
folder on the way could swap it for a link to anywhere. So a root, once :mod:`.safety` checked it
(:func:`anchor_root`), is the anchor of every path under it: the root is opened and
checked on its descriptor, its identity (device and inode) compared with the one the
walk from ``/`` found (:mod:`.path_walk`), so a root swapped since is never entered,
and the path walked from there, each folder opened with ``O_NOFOLLOW |
O_DIRECTORY`` relative to the one before (``openat``) and checked on the descriptor
itself (``fstat``: ours, writable by nobody else), and the file opened, stat'ed,
renamed or removed relative to the last folder's descriptor. A link anywhere on the
way is refused, never followed; what is checked is what is used.

A path under no root opened this way (a file of a root not opened yet) has its folder
walked from ``/`` as a root's path is (:mod:`.path_walk`), and its last name opened
without following a link.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import os
import stat
import weakref

from .checks import RootChanged, VaultError, check_file_safe, check_folder_private, check_owned
from .path_walk import walk_to

__all__ = ["FolderFd", "anchor_root", "open_folder", "in_folder", "open_in", "lstat_in", "unlink_in", "rename_in",
           "remove_tree_in", "mkdir_in", "listdir_in"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ROOTS: dict[str, tuple[int, int]] = {}  # the absolute roots checked by this process: their (st_dev, st_ino)
_ROOTS_LOCK = _thread.allocate_lock()  # threading's Lock: a plan that checks a root imports no threading


def _check_folder(path: str, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise VaultError(f"{path}: exists and is not a folder; move it away or choose another cache root.")
    check_owned(path, st)
    check_folder_private(path, st)


def _open_root(root: str) -> int:
    """Open ``root`` and check the folder on its descriptor: the very folder the walk from
    ``/`` checked (its device and inode), ours, writable by nobody else."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        with _ROOTS_LOCK:
            known = _ROOTS.get(root)
        if known is not None and (st.st_dev, st.st_ino) != known:
            raise RootChanged(f"{root}: is no longer the folder checked when the cache opened it (device:inode "
                             f"{known[0]}:{known[1]}, now {st.st_dev}:{st.st_ino}): a folder on the way was replaced "
                             "or remounted; the cache never enters a root it did not check. Start again.")
        _check_folder(root, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def anchor_root(root: str, st: os.stat_result) -> None:
    """Walk every path below ``root`` (checked by :func:`~.safety.check_root`, ``st`` its
    descriptor's ``fstat``) from its descriptor from now on. The descriptor is opened for
    each walk, its identity checked against ``st``, not held: one held for the process's
    life would keep a disk the root is on from being unmounted once nothing of it is
    mapped any more; a root remounted since is refused until it is checked again."""
    with _ROOTS_LOCK:
        _ROOTS[root] = (st.st_dev, st.st_ino)


def _anchored(path: str) -> tuple[str | None, list[str]]:
    """The registered root ``path`` lies under (the longest), and the names below it."""
    path = os.path.abspath(path)
    with _ROOTS_LOCK:
        roots = [r for r in _ROOTS if path == r or path.startswith(r.rstrip("/") + "/")]
    if not roots:
        return None, []
    root = max(roots, key=len)
    return root, [n for n in path[len(root):].split("/") if n]


def _refused_link(path: str) -> VaultError:
    """A link (or a file) where the cache keeps a folder: removed by ``rm``, which removes a
    link itself; ``hostmem cache rm`` removes a combination's folder, which walks here too."""
    return VaultError(f"{path}: is a symlink or not a folder; the cache never follows links inside itself. "
                      f"Remove it (`rm {path}`) and start again.")


def open_folder(path: str) -> int:
    """A descriptor of folder ``path``, walked from its root's descriptor without following
    a link, each cache folder on the way checked on its descriptor (ours, private).
    ``FileNotFoundError`` when a folder on the way is missing."""
    root, names = _anchored(path)
    if root is None:  # a folder under no root checked yet: walked from / as a root's path is
        return walk_to(os.path.abspath(path))
    fd, walked = _open_root(root), root
    try:
        for name in names:
            walked = f"{walked}/{name}"
            try:
                nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refused_link(walked) from None
                if exc.errno in (errno.EACCES, errno.EPERM):
                    raise _denied(exc, walked, folder=True) from None
                raise
            os.close(fd)
            fd = nxt
            _check_folder(walked, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def in_folder(path: str):
    """``(descriptor of path's folder, path's last name)``, the folder walked as
    :func:`open_folder` walks it and closed on leaving."""
    folder, name = os.path.split(os.path.abspath(path))
    fd = open_folder(folder)
    try:
        yield fd, name
    finally:
        os.close(fd)


def _denied(exc: OSError, path: str, folder: bool) -> PermissionError:
    """``exc`` for a part of the cache this user may not open, naming it whole and the fix."""
    mode, may = ("u+rwx", "readable") if folder else ("u+rw", "readable and writable")
    return PermissionError(exc.errno, f"{os.strerror(exc.errno)}: {path} (a part of the cache this user may not "
                                      f"open: make it its own and {may}, `chmod {mode} {path}`, or remove it)")


def open_in(path: str, flags: int = os.O_RDONLY, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """Open a file of the cache relative to its folder's descriptor (``dir_fd``, else its
    folder walked from the root): no link followed, a special file refused before it is
    opened, the file opened checked on its descriptor (:func:`~.safety.check_file_safe`)."""
    if dir_fd is None:
        with in_folder(path) as (folder_fd, name):
            return open_in(path, flags, mode, folder_fd)
    name = os.path.basename(path)
    try:
        check_file_safe(path, os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        if not flags & os.O_CREAT:
            raise
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except PermissionError as exc:
        raise _denied(exc, path, folder=False) from None
    try:
        check_file_safe(path, os.fstat(fd))  # the very file opened, not one swapped in since
    except BaseException:
        os.close(fd)
        raise
    return fd


def lstat_in(path: str, dir_fd: int | None = None) -> os.stat_result:
    """``lstat`` of ``path`` relative to its folder's descriptor."""
    if dir_fd is not None:
        return os.stat(os.path.basename(path), dir_fd=dir_fd, follow_symlinks=False)
    with in_folder(path) as (fd, name):
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def listdir_in(path: str) -> list[str]:
    """The names in folder ``path``, the folder opened as :func:`open_folder` opens it."""
    fd = open_folder(path)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def unlink_in(path: str) -> None:
    """Remove the entry ``path`` (a link itself, never what it points to) from its folder."""
    with in_folder(path) as (fd, name):
        os.unlink(name, dir_fd=fd)


def rename_in(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, both relative to their folders' descriptors."""
    with in_folder(src) as (src_fd, src_name), in_folder(dst) as (dst_fd, dst_name):
        os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def mkdir_in(path: str, mode: int = 0o700) -> None:
    """Create folder ``path`` in its folder's descriptor (``FileExistsError`` if there)."""
    with in_folder(path) as (fd, name):
        os.mkdir(name, mode, dir_fd=fd)
        _chmod_new(fd, name, mode)


def _chmod_new(parent_fd: int, name: str, mode: int) -> None:
    """Make the folder just created exactly ``mode`` (the umask may have narrowed it),
    on its own descriptor: never through a link swapped in since."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def remove_tree_in(path: str) -> None:
    """Remove ``path`` from its folder: a folder with everything in it (links inside
    unlinked, never followed: ``rmtree`` walks by descriptors), else the entry itself.
    Missing is fine."""
    try:
        with in_folder(path) as (fd, name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(st.st_mode):
                import shutil  # here: shutil imports bz2 and lzma, and a plan only checks roots

                shutil.rmtree(name, dir_fd=fd)
            else:
                os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        return


class FolderFd:
    """A key folder's descriptor for a session's many files (its layers, their stamps),
    opened from the root's on first use and kept: each layer is then opened with one
    ``openat``. :meth:`run` calls ``fn(fd)``, and again with the folder opened anew when
    it is not found because the folder was removed since (dropped and made again)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        self._closer = None
        self._lock = _thread.allocate_lock()  # a build's writer and its seals take descriptors at once

    def _open(self) -> int:
        self.close()
        self._fd = open_folder(self.path)
        self._closer = weakref.finalize(self, os.close, self._fd)
        return self._fd

    def dup(self) -> int:
        """A descriptor of the folder of the caller's own (it closes it): a copy of the one
        kept, or of the folder opened anew where the one kept was removed since."""
        with self._lock:
            fd = self._fd if self._fd is not None else self._open()
            if not os.fstat(fd).st_nlink:  # removed (dropped and made again): open what is there now
                fd = self._open()
            return os.dup(fd)

    def run(self, fn):
        with self._lock:
            fd = self._fd if self._fd is not None else self._open()
        try:
            return fn(fd)
        except FileNotFoundError:
            if os.fstat(fd).st_nlink:
                raise  # the folder is there: the file is not
        with self._lock:
            fd = self._open()
        return fn(fd)

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
        self._fd = self._closer = None
