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

import errno
import fcntl
import functools
import mmap
import os
import shutil
import stat

__all__ = [
    "TMP_PREFIX",
    "fsync_dir",
    "write_all",
    "start_writeback",
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
_CHUNK = 8 * 1024 * 1024


def fsync_dir(path: str) -> None:
    """fsync a folder so that a rename or unlink in it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


@functools.cache
def _sync_file_range():
    """libc's sync_file_range (Linux), or None where the C library lacks it."""
    try:
        import ctypes  # only a build flushes ranges; `hostmem cache` starts without it

        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` to disk now, without waiting.

    A hint that makes the later fsync short: the disk works on a layer's first chunks
    while its last ones are still being written, instead of idling until the fsync and
    then taking the whole layer at once. It promises nothing about durability (the
    fsync still does), so where the call is missing or fails it is simply skipped.
    """
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def write_all(fd: int, data, offset: int, writeback: bool = False) -> None:
    """pwrite every byte of ``data`` at ``offset`` (pwrite may write less than asked).

    ``writeback`` starts the disk on each chunk as soon as it is written
    (:func:`start_writeback`), for large files that are fsynced next.
    """
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view[:_CHUNK], offset)
        if writeback:
            start_writeback(fd, offset, written)
        view = view[written:]
        offset += written


DIRECT_ALIGN = 4096  # O_DIRECT needs address, offset and length in whole logical blocks; a page covers every disk
_DIRECT_CHUNK = 64 * 1024 * 1024


def _write_direct(path: str, data: memoryview, offset: int) -> int:
    """Write ``data`` (whole, aligned pages) at ``offset`` of ``path`` with O_DIRECT.

    Returns the bytes written: all of them, or fewer (0 at first) where the filesystem
    refuses O_DIRECT or these alignments (EINVAL), so the caller writes the rest its
    usual way. Any other error (no space, file too large, I/O) is raised.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return 0
        raise
    done = 0
    try:
        while done < len(data):
            try:
                done += os.pwrite(fd, data[done : done + _DIRECT_CHUNK], offset + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    break
                raise
    finally:
        os.close(fd)
    return done - done % DIRECT_ALIGN


def write_uncached(fd: int, path: str, data, offset: int, address: int) -> None:
    """Write ``data`` (in memory at ``address``) at ``offset`` of ``path``, open as ``fd``,
    without passing it through the page cache where the filesystem allows.

    Its whole pages go with O_DIRECT through a second descriptor: the disk reads them
    from our buffer, with no copy into newly allocated page cache (on a virtual machine,
    touching fresh pages can cost more than the disk), and the build does not push out
    of the cache what it holds, such as the base checkpoint being merged. What O_DIRECT
    cannot take (an unaligned buffer or offset, the last partial page, a filesystem
    without it) goes through ``fd`` as usual. The later fsync is still what makes it
    durable: O_DIRECT skips the page cache, not the disk's own.
    """
    data = memoryview(data).cast("B")
    body = 0
    if address % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0:
        body = len(data) - len(data) % DIRECT_ALIGN
    if body:
        body = _write_direct(path, data[:body], offset)
    write_all(fd, data[body:], offset + body, writeback=True)


_STAGE = 64 * 1024 * 1024  # bytes staged per O_DIRECT write


def write_uncached_pieces(fd: int, path: str, pieces: list) -> None:
    """Write ``pieces`` (buffers) one after another from offset 0 of ``path``, open as
    ``fd``, around the page cache where the filesystem allows (:func:`write_uncached`):
    copied through a page-aligned staging buffer, so that every write but the last is
    whole pages at a page-aligned offset, whatever the pieces' own sizes."""
    import ctypes  # see _sync_file_range

    stage = mmap.mmap(-1, _STAGE)
    view = memoryview(stage)
    anchor = ctypes.c_char.from_buffer(stage)
    try:
        address, filled, at = ctypes.addressof(anchor), 0, 0
        for piece in pieces:
            piece = memoryview(piece).cast("B")
            while piece:
                n = min(len(piece), _STAGE - filled)
                view[filled : filled + n] = piece[:n]
                filled, piece = filled + n, piece[n:]
                if filled == _STAGE:
                    write_uncached(fd, path, view, at, address)
                    at, filled = at + filled, 0
        if filled:
            write_uncached(fd, path, view[:filled], at, address)
    finally:
        del anchor
        view.release()
        stage.close()


def tmp_path_in(folder: str, suffix: str = "") -> str:
    """A fresh temporary name in ``folder`` (same filesystem, so the rename is atomic)."""
    return os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}{suffix}")


def _same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed, not replaced)."""
    try:
        named = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def open_tmp(folder: str, suffix: str = "") -> tuple[int, str]:
    """Create a new 0600 temporary file in ``folder``, never through a symlink, and hold
    its writer's lock (see the module docstring) until :func:`seal` or ``os.close``.

    A sweep may take the lock in the instant between creating the file and locking it;
    it removes the file while holding the lock, so once ours is granted the name is
    checked to still be our file, and a new one is made if it is not.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        path = tmp_path_in(folder, suffix)
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                return fd, path
        except BaseException:
            os.close(fd)
            discard(path)
            raise
        os.close(fd)


def _open_to_probe(path: str) -> int:
    """Open a temporary file to take its lock: for writing where allowed (NFS grants an
    exclusive flock only on a file open for writing), else for reading."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | flags)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
    return os.open(path, os.O_RDONLY | flags)


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
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def seal(fd: int, tmp: str, final: str, sync_dir: bool = True) -> None:
    """fsync, rename into place, close and fsync the folder: the file is now durable.

    The rename comes before the close, so the writer's lock covers the temporary name
    for as long as it exists. ``sync_dir=False`` leaves the folder's fsync to a later
    seal in the same folder (the manifest's): the file's data is on disk before its
    name, so a crash in between can lose the name, never serve a torn file. On any
    failure the temporary file is removed, so nothing partial stays behind.
    """
    try:
        os.fsync(fd)
        os.rename(tmp, final)
    except BaseException:
        discard(tmp)
        os.close(fd)
        raise
    os.close(fd)
    if sync_dir:
        fsync_dir(os.path.dirname(final))


def discard(path: str) -> None:
    """Remove a file if it is there (cleanup must not raise over the real error)."""
    try:
        os.unlink(path)
    except OSError:
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
    from .safety import read_trusted  # here: safety builds on this module

    return read_trusted(path)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def remove_tree(path: str) -> None:
    """Remove a cache folder; links inside are unlinked, never followed."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
