"""Writing large buffers to a file: every byte, the disk started early, around the page cache;
and the folder fsync that makes a rename durable.

Below the vault and the safetensors writer alike (both write checkpoints and layers of
gigabytes), so neither reaches into the other; ``hostmem.vault.durable`` re-exports
these for the callers that know them from there.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import mmap
import os

__all__ = ["DIRECT_ALIGN", "fsync_dir", "start_writeback", "write_all", "write_cached", "write_uncached",
           "write_uncached_pieces"]

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


def _open_direct(open_fd: int, path: str) -> int:
    """A second descriptor of the file open as ``open_fd``, with O_DIRECT: reopened through
    ``/proc/self/fd`` (the very file, whatever its path names by now, and no walk of the
    path's folders), else by ``path`` where /proc is not there. A descriptor not open for
    writing gets the error a write through it would."""
    if fcntl.fcntl(open_fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
        raise OSError(errno.EBADF, f"{path}: not open for writing", path)
    flags = os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC
    try:
        return os.open(f"/proc/self/fd/{open_fd}", flags)
    except FileNotFoundError:
        return os.open(path, flags | os.O_NOFOLLOW)


def _write_direct(open_fd: int, path: str, data: memoryview, offset: int) -> int:
    """Write ``data`` (whole, aligned pages) at ``offset`` of the file open as ``open_fd``
    (``path``) with O_DIRECT.

    Returns the bytes written: all of them, or fewer (0 at first) where the filesystem
    refuses O_DIRECT or these alignments (EINVAL), so the caller writes the rest its
    usual way. Any other error (no space, file too large, I/O) is raised.
    """
    try:
        fd = _open_direct(open_fd, path)
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
        body = _write_direct(fd, path, data[:body], offset)
    write_all(fd, data[body:], offset + body, writeback=True)


def write_cached(fd: int, path: str, data, offset: int, address: int) -> None:
    """Write ``data`` at ``offset`` of ``path``, open as ``fd``, through the page cache,
    where the bytes then stay: :func:`write_uncached`'s twin for bytes that should stay
    in the page cache (``path`` and ``address`` are not needed; they are taken so that
    either may be passed where the other is). No writeback is started: the disk is left
    to the later fsync (or the kernel's own writeback), so a build that reads its inputs
    from the same disk does not share it with its writes. The fsync is what makes it
    durable, as there."""
    write_all(fd, data, offset)


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
