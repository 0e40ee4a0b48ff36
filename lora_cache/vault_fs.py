"""The vault's dealings with the filesystem: a safe root, durable writes, locks, free space.

Everything the vault stores must survive a crash at any instant without ever
serving a torn file, and must not be a door for another user. So: files are
written to a temporary name in their final folder, fsynced, renamed, and the
folder fsynced (a rename is atomic; the folder fsync makes it durable); nothing
in the cache is opened through a symlink; the root is created 0700 and refused
when others may write into it or when it lives on tmpfs, whose pages are shared
memory the kernel cannot drop without swap (mapping merged weights from there
would save no host memory at all).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import secrets
import shutil
import stat
from dataclasses import dataclass

from hostmem.procfs import SHMEM_FS_TYPES, filesystem_of

__all__ = [
    "VaultError",
    "TMP_PREFIX",
    "prepare_root",
    "check_not_tmpfs",
    "check_not_symlink",
    "check_folder_private",
    "make_private_dir",
    "fsync_dir",
    "write_all",
    "start_writeback",
    "write_uncached",
    "DIRECT_ALIGN",
    "tmp_path_in",
    "open_tmp",
    "seal",
    "discard",
    "durable_write",
    "free_bytes",
    "remove_tree",
    "KeyLock",
    "lock_is_held",
]

TMP_PREFIX = ".tmp-"
_CHUNK = 8 * 1024 * 1024


class VaultError(ValueError):
    """The cache cannot be used as configured; the message names the path and the fix.

    A ``ValueError`` so that the command line prints it as one actionable line.
    """


def _nearest_existing(path: str) -> str:
    """Return ``path`` or its closest existing ancestor (to learn its filesystem)."""
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_not_tmpfs(path: str) -> None:
    """Refuse a cache folder on tmpfs: its pages cannot be reclaimed without swap."""
    mount = filesystem_of(_nearest_existing(path))
    if mount is not None and mount.fs_type in SHMEM_FS_TYPES:
        raise VaultError(
            f"{path}: on {mount.fs_type} (mounted at {mount.mount_point}); pages there are shared "
            "memory the kernel cannot drop without swap, so a merge cache there saves no host "
            "memory. Choose a folder on a disk-backed filesystem (--root DIR or HOSTMEM_CACHE_ROOT, "
            "e.g. ~/.cache/hostmem)."
        )


def check_folder_private(path: str, st: os.stat_result | None = None) -> None:
    """Refuse a folder that others may write into without the sticky bit.

    Anyone who can write there could plant or swap a layer file that we would then
    serve as model weights.
    """
    st = os.lstat(path) if st is None else st
    if stat.S_ISLNK(st.st_mode):
        check_not_symlink(path, st)
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise VaultError(
            f"{path}: writable by every user (mode {stat.S_IMODE(st.st_mode):04o}) without the "
            "sticky bit, so another user could replace cached weights. Run `chmod o-w` on it "
            "(or `chmod +t`), or choose another cache root."
        )


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
    blocker = _nearest_existing(os.path.dirname(path))
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
    """Create ``path`` 0700 if missing; an existing one must be a real folder of ours.

    A folder another user owns could have its files replaced by that user, even when
    its mode looks private to us, so it is refused like a world-writable one.
    """
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # the umask may have narrowed it; never widened, but be exact
        fsync_dir(os.path.dirname(path))  # the new folder's entry survives a crash too
    except FileExistsError:
        pass
    except OSError as exc:
        raise _cannot_create(path, exc) from None
    st = check_not_symlink(path)
    if not stat.S_ISDIR(st.st_mode):
        raise VaultError(f"{path}: exists and is not a folder; move it away or choose another cache root.")
    if st.st_uid not in (os.geteuid(), 0):
        raise VaultError(
            f"{path}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}), who could replace "
            "cached weights. Remove it or choose a cache root of your own (--root DIR or HOSTMEM_CACHE_ROOT)."
        )
    check_folder_private(path, st)


def prepare_root(root: str | os.PathLike) -> str:
    """Return the absolute root, created 0700 if missing, after the safety checks."""
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    check_not_tmpfs(root)
    if not os.path.isdir(root):
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
    if not os.path.isdir(root):
        raise VaultError(f"{root}: exists and is not a folder; choose another cache root.")
    check_folder_private(root, os.stat(root))  # the root itself may be a symlink to a disk
    check_not_tmpfs(root)
    return root


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


def tmp_path_in(folder: str, suffix: str = "") -> str:
    """A fresh temporary name in ``folder`` (same filesystem, so the rename is atomic)."""
    return os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def open_tmp(folder: str, suffix: str = "") -> tuple[int, str]:
    """Create a new 0600 temporary file in ``folder``; never through a symlink."""
    path = tmp_path_in(folder, suffix)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, 0o600), path


def seal(fd: int, tmp: str, final: str, sync_dir: bool = True) -> None:
    """fsync, close, rename into place and fsync the folder: the file is now durable.

    ``sync_dir=False`` leaves the folder's fsync to a later seal in the same folder (the
    manifest's): the file's data is on disk before its name, so a crash in between can
    lose the name, never serve a torn file. On any failure the temporary file is
    removed, so nothing partial stays behind.
    """
    try:
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        discard(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, final)
    except BaseException:
        discard(tmp)
        raise
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


@dataclass
class KeyLock:
    """An exclusive (or shared) flock on ``path``, released by the kernel if we die.

    After the lock is taken the path is checked to still name the locked inode: a
    remover deletes the lock file while holding it, and a waiter that then wakes up
    holds a lock on a file nobody else can see, so it starts over.
    """

    path: str
    fd: int = -1

    def acquire(self, exclusive: bool = True, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` return False when someone holds it."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            if self._still_named(fd):
                self.fd = fd
                return True
            os.close(fd)

    def _still_named(self, fd: int) -> bool:
        try:
            named = os.lstat(self.path)
        except FileNotFoundError:
            return False
        held = os.fstat(fd)
        return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release_and_remove_if_alone(self) -> None:
        """Release the lock, removing its file only when nobody else holds it.

        For a reader that created the lock file just to hold it a while: it leaves the
        folder as it found it. The file goes only under an exclusive lock (taken without
        waiting), as every remover takes it.
        """
        if self.fd < 0:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.release()
        else:
            self.release(remove=True)

    def release(self, remove: bool = False) -> None:
        """Release the lock; ``remove`` deletes the lock file first (while still held)."""
        if self.fd < 0:
            return
        if remove:
            discard(self.path)
        os.close(self.fd)  # closing the last descriptor releases the flock
        self.fd = -1


def lock_is_held(path: str, shared_too: bool) -> bool:
    """Whether some open file holds a flock on ``path``; asks without waiting.

    A query only: it never creates, removes or keeps the lock file. ``shared_too``
    counts shared holders as well (the probe asks for an exclusive lock); otherwise only
    an exclusive holder counts (the probe asks for a shared one, so that it does not get
    in the way of other shared holders). The probe's own lock is dropped at once.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if shared_too else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
