"""flock-based locks of the vault: released by the kernel when their holder dies."""

from __future__ import annotations

import errno
import fcntl
import os
from dataclasses import dataclass

from .anchor import in_folder, lstat_in
from .checks import VaultError
from .durable import discard
from .safety import open_trusted

__all__ = ["KeyLock", "lock_is_held", "lock_holders", "describe_holders"]


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
            fd = open_trusted(self.path, os.O_RDWR | os.O_CREAT)  # ours, a regular file, no link followed
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
            named = lstat_in(self.path)  # in its folder's descriptor, walked from the root's
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
        with in_folder(path) as (folder_fd, name):  # walked from the root's descriptor; a FIFO never hangs it
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder_fd)
    except FileNotFoundError:
        return False
    except VaultError as exc:  # a folder on the way is a link: an error of the file, as a link to the lock is
        raise OSError(errno.ELOOP, str(exc)) from None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if shared_too else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def lock_holders(path: str) -> list[tuple[int, int | None]]:
    """``(pid, uid)`` of each process holding a flock on ``path``, as ``/proc/locks`` names
    them (the uid None where the process is gone or hidden); empty where none is known.
    For messages only: who holds a key's lock, so that a person can act on it."""
    try:
        inode = os.lstat(path).st_ino
        with open("/proc/locks") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":  # "->": a waiter, not a holder
            continue
        try:
            pid, where = int(fields[4]), fields[5]
        except ValueError:
            continue
        if where.rsplit(":", 1)[-1] == str(inode):
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                uid = None
            found.append((pid, uid))
    return found


def describe_holders(holders: list[tuple[int, int | None]]) -> str:
    """``"pid 123 (uid 0)"``, joined; ``"a process this one cannot see"`` where none is known."""
    if not holders:
        return "a process this one cannot see (another container or host)"
    return ", ".join(f"pid {pid} (uid {'?' if uid is None else uid})" for pid, uid in holders)
