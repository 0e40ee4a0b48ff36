"""flock-based locks of the vault: released by the kernel when their holder dies.

No lock is waited for without end: anyone who can read a lock file (a root an operator
made readable by others, ``chmod -R go+rX``) can hold a flock on it for ever, so every
wait is bounded (:meth:`KeyLock.acquire_within`, :func:`lock_wait_s`), and who holds a
lock is read from ``/proc/locks`` (:func:`lock_holders`) to say so and to tell another
user's hold, which never means work of ours in progress, from a process of ours.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from dataclasses import dataclass

from ..procfs import ProcReadError
from ..procfs.mounts import filesystem_of
from .anchor import in_folder, lstat_in
from .checks import VaultError
from .durable import discard
from .safety import open_trusted

__all__ = ["KeyLock", "lock_is_held", "lock_holders", "describe_holders", "held_by_others", "foreign_hold",
           "close_to_others", "lock_wait_s",
           "say", "flock_within", "DEFAULT_LOCK_WAIT_S", "SHORT_WAIT_S"]

DEFAULT_LOCK_WAIT_S = 1800.0  # see lock_wait_s
SHORT_WAIT_S = 2.0  # a lock only held for an instant by a process of ours (a probe): longer is someone else


def say(message: str) -> None:
    """One line to the person running the start (standard error)."""
    print(f"hostmem: {message}", file=sys.stderr, flush=True)


def lock_wait_s(short: bool = False) -> float:
    """How long a start waits for a lock: ``HOSTMEM_LOCK_TIMEOUT`` seconds, else
    :data:`DEFAULT_LOCK_WAIT_S` (a build of a large model takes minutes; one that holds
    the lock much longer is stuck), or at most :data:`SHORT_WAIT_S` for a lock a process
    of ours holds only for an instant (``short``)."""
    text = os.environ.get("HOSTMEM_LOCK_TIMEOUT", "")
    try:
        bound = max(0.0, float(text)) if text else DEFAULT_LOCK_WAIT_S
    except ValueError:
        raise VaultError(f"HOSTMEM_LOCK_TIMEOUT={text!r}: not a number of seconds") from None
    if bound != bound or bound == float("inf"):
        raise VaultError(f"HOSTMEM_LOCK_TIMEOUT={text!r}: give a finite number of seconds")
    return min(bound, SHORT_WAIT_S) if short else bound


@dataclass
class KeyLock:
    """An exclusive (or shared) flock on ``path``, released by the kernel if we die.

    After the lock is taken the path is checked to still name the locked inode: a
    remover deletes the lock file while holding it, and a waiter that then wakes up
    holds a lock on a file nobody else can see, so it starts over.
    """

    path: str
    fd: int = -1
    exposed: bool = False  # others could open the lock file (see close_to_others)

    def acquire(self, exclusive: bool = True, blocking: bool = True) -> bool:
        """Take the lock; with ``blocking=False`` return False when someone holds it."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        while True:
            fd = open_trusted(self.path, os.O_RDWR | os.O_CREAT)  # ours, a regular file, no link followed
            self.exposed |= close_to_others(fd, self.path)
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

    def acquire_within(self, seconds: float | None = None, exclusive: bool = True) -> bool:
        """Take the lock, waiting at most ``seconds`` (else :func:`lock_wait_s`), and no
        longer than the short bound once every holder is another user's (polling, so
        that no wait is for ever); False when it is still held then."""
        started, pause = time.monotonic(), 0.005
        bound = lock_wait_s() if seconds is None else seconds
        short = min(bound, lock_wait_s(short=True))
        while not self.acquire(exclusive, blocking=False):
            waited = time.monotonic() - started
            if waited >= bound or (waited >= short and foreign_hold(lock_holders(self.path), self.exposed)):
                return self.acquire(exclusive, blocking=False)  # unless it was just let go (unseen: gone)
            time.sleep(min(pause, max(bound - waited, 0.001)))
            pause = min(2 * pause, 0.25)
        return True

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


HIDDEN = -1  # the uid of a holder /proc/locks names in this pid namespace whose /proc entry hides it
GONE = -2  # the "uid" of a holder that has exited: a process it passed the descriptor on to holds the lock


def lock_holders(path: str) -> list[tuple[int, int | None]]:
    """``(pid, uid)`` of each process holding a flock on ``path``, as ``/proc/locks`` names
    them; empty where none is known. The uid is :data:`HIDDEN` where ``/proc/PID`` cannot
    be seen (``hidepid``: a process of this user's is always seen, so it is another
    user's), :data:`GONE` where the process that took the lock has exited (a process it
    passed the descriptor to holds it: anyone's), None where the pid is none of this
    namespace's (0)."""
    try:
        stat = os.lstat(path)
        with open("/proc/locks") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    # MAJOR:MINOR:INODE names the file by its superblock's device: stat's own, or (a btrfs
    # subvolume's stat shows a device of its own) the one mountinfo gives its mount
    try:
        mount = filesystem_of(path)
    except ProcReadError:
        mount = None
    devices = {stat.st_dev} | ({mount.device} if mount is not None and mount.device is not None else set())
    found = []
    for line in lines:
        fields = line.split()
        if "->" in fields or len(fields) < 6 or fields[1] != "FLOCK":  # "->": a waiter, not a holder
            continue
        try:
            pid, (major, minor, inode) = int(fields[4]), fields[5].split(":")
            device = os.makedev(int(major, 16), int(minor, 16))
        except ValueError:
            continue
        if inode == str(stat.st_ino) and device in devices:
            found.append((pid, _holder_uid(pid)))
    return found


def _holder_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid if pid > 0 else None
    except FileNotFoundError:  # hidden (hidepid=2), or the process that took the lock has exited
        return GONE if pid_exited(pid) else HIDDEN
    except OSError:
        return HIDDEN


def pid_exited(pid: int) -> bool:
    """Whether no process ``pid`` exists in this pid namespace (another user's, which
    ``/proc`` may hide, still does)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def flock_within(fd: int, path: str, exclusive: bool = True) -> bool:
    """Lock open file ``fd`` (named ``path``), waiting at most :func:`lock_wait_s` for a
    process of ours, and no longer than its short bound once every holder is another
    user's (never work of ours: waiting for it is waiting for ever). False when not taken."""
    mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    started, pause = time.monotonic(), 0.005
    short, bound = lock_wait_s(short=True), lock_wait_s()
    exposed = close_to_others(fd, path)
    while True:
        try:
            fcntl.flock(fd, mode)
            return True
        except BlockingIOError:
            waited = time.monotonic() - started
            if waited >= bound:
                return False
            if waited >= short and foreign_hold(lock_holders(path), exposed):
                with contextlib.suppress(BlockingIOError):  # a hidden holder may be one that just ended
                    fcntl.flock(fd, mode)
                    return True
                return False
            time.sleep(min(pause, max(bound - waited, 0.001)))
            pause = min(2 * pause, 0.25)


def close_to_others(fd: int, path: str) -> bool:
    """Whether others may hold the lock file ``path``, open as ``fd`` (ours): it lets them
    open it, or its folder lets them reach it (a root shared with ``chmod -R go+rX``,
    where the file may have been open to them before). The file is made ``0600``, so none
    opens it from now on; one that opened it before may hold it still, which
    :func:`foreign_hold` counts."""
    st = os.fstat(fd)
    if st.st_mode & 0o077:
        with contextlib.suppress(OSError):  # a read-only filesystem: it stays as it is
            os.fchmod(fd, 0o600)
        return True
    try:
        return bool(os.stat(os.path.dirname(os.path.abspath(path))).st_mode & 0o011)
    except OSError:
        return False


def foreign_hold(holders: list[tuple[int, int | None]], exposed: bool) -> bool:
    """Whether a hold is never work of ours in progress: every holder another user's
    (:func:`held_by_others`), or, on a lock file others could open, none listed at all or
    each listed one another user's or exited. ``/proc/locks`` lists only the holders in
    this pid namespace, so from a container a hold from the host or another container is
    unseen; and it names the process that took the lock, which may have passed the
    descriptor on and exited (``flock FILE cmd &``). On a lock file only we can open,
    either is ours (a build in another container, a child of ours: waited for); on one
    others could open it may be anyone's, and waiting for it may be waiting for ever."""
    mine = os.geteuid()  # HIDDEN and GONE are never a uid: both count on an exposed file
    return held_by_others(holders) or (exposed and all(uid is not None and uid != mine for _, uid in holders))


def held_by_others(holders: list[tuple[int, int | None]]) -> bool:
    """Whether every known holder is another user's process (one ``/proc`` hides from this
    user counts: this user's own are never hidden): never work of ours in progress, so
    waiting for it is waiting for ever."""
    return bool(holders) and all(uid not in (None, GONE) and uid != os.geteuid() for _, uid in holders)


def describe_holders(holders: list[tuple[int, int | None]]) -> str:
    """``"pid 123 (uid 0)"``, joined; ``"a process this one cannot see"`` where none is known."""
    if not holders:
        return "a process this one cannot see (another container or host)"

    def who(uid: int | None) -> str:
        if uid == HIDDEN:
            return "another user's, hidden by /proc"
        if uid == GONE:
            return "exited; a process it passed the lock's descriptor to holds it"
        return f"uid {'?' if uid is None else uid}"

    return ", ".join(f"pid {pid} ({who(uid)})" for pid, uid in holders)
