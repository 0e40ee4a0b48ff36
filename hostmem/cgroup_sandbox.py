"""A memory cgroup of its own, nested under this process's own cgroup.

Two uses. With a limit it shows a real kill: a child started inside the group is
charged for what it touches, and the kernel's OOM killer ends it when it goes over.
Without one it counts: ``hostmem guard`` starts its command inside a group, and the
group's anonymous figure (:meth:`MemoryCgroup.anon_bytes`) covers every process the
command starts, once per page, including daemons that re-parent away from it. The
group is created under the cgroup the process is already in (from /proc/self/cgroup),
never beside it or at the root, and removed afterwards. Where the machine does not
allow it, :func:`can_nest_memory_cgroup` says why and nothing is created.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from contextlib import contextmanager
from typing import Iterator, NamedTuple

from .procfs import ProcReadError, memory_cgroup_dir

__all__ = ["MemoryCgroup", "STAT_KEYS", "can_nest_memory_cgroup", "memory_cgroup"]

# memory.stat keys of (anonymous, shmem) bytes, hierarchical (subgroups included), by version
STAT_KEYS = {1: ("total_rss", "total_shmem"), 2: ("anon", "shmem")}


class MemoryCgroup(NamedTuple):
    """A nested memory cgroup: where it is, which version, and how to put a process in."""

    path: str
    version: int
    limit_bytes: int | None

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    @property
    def stat_file(self) -> str:
        return os.path.join(self.path, "memory.stat")

    def pids(self) -> list[int]:
        """The processes in the group now (an empty list once the group is gone)."""
        try:
            with open(self.procs_file) as handle:
                return [int(line) for line in handle if line.strip()]
        except FileNotFoundError:
            return []

    def anon_bytes(self, include_shmem: bool = False) -> int:
        """Anonymous memory charged to the group and its subgroups, each page once.

        From memory.stat: ``total_rss`` in v1, ``anon`` in v2 (plus the shmem
        figure when asked). Not ``usage``: that one includes page cache.
        """
        try:
            with open(self.stat_file) as handle:
                stat = dict(line.split() for line in handle if line.count(" ") == 1)
        except OSError as exc:
            raise ProcReadError(f"{self.stat_file}: {exc.strerror}") from None
        keys = STAT_KEYS[self.version][: 2 if include_shmem else 1]
        return sum(int(stat.get(key, 0)) for key in keys)

    def signal_all(self, signum: int) -> int:
        """Send ``signum`` to every process in the group now; returns how many were sent it."""
        sent = 0
        for pid in self.pids():
            try:
                os.kill(pid, signum)
                sent += 1
            except ProcessLookupError:
                pass
        return sent

    def kill_all(self) -> int:
        """SIGKILL every process in the group until none is left; returns how many were sent."""
        sent = 0
        for _ in range(100):  # a process may fork while the list is read: read it again
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    sent += 1
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        return sent

    def move_out(self) -> list[int]:
        """Move every process still in the group to the parent group; returns their pids.

        What a command leaves running (a daemon) keeps running; only the group goes.
        """
        moved = []
        parent = os.path.join(os.path.dirname(self.path), "cgroup.procs")
        for pid in self.pids():
            try:
                _write(parent, str(pid))
                moved.append(pid)
            except ProcessLookupError:
                pass  # exited meanwhile
        return moved

    def join(self) -> None:
        """Move the calling process into the group (use as a ``preexec_fn``)."""
        with open(self.procs_file, "w") as handle:
            handle.write(str(os.getpid()))

    def oom_kills(self) -> int:
        """How many processes the kernel's OOM killer ended in this group."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        try:
            with open(os.path.join(self.path, name)) as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError as exc:
            raise ProcReadError(f"{os.path.join(self.path, name)}: {exc.strerror}") from None
        return 0


def _own_group() -> tuple[int, str]:
    found = memory_cgroup_dir()
    if found is None:
        raise OSError("this process is in no memory cgroup that this machine exposes")
    version, folder, _ = found
    return version, folder


def can_nest_memory_cgroup() -> str | None:
    """``None`` when a limited group can be nested here, else the reason it cannot."""
    try:
        version, folder = _own_group()
    except (OSError, ProcReadError) as exc:
        return str(exc)
    if not os.path.isdir(folder):
        return f"{folder}: this process's memory cgroup is not mounted here"
    if not os.access(folder, os.W_OK):
        return f"{folder}: not writable (creating a memory cgroup needs root or a delegated group)"
    if version == 2:
        controllers = os.path.join(folder, "cgroup.subtree_control")
        try:
            with open(controllers) as handle:
                if "memory" not in handle.read().split():
                    return f"{controllers}: the memory controller is not enabled for child groups"
        except OSError as exc:
            return f"{controllers}: {exc.strerror}"
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


@contextmanager
def memory_cgroup(limit_bytes: int | None, name: str | None = None) -> Iterator[MemoryCgroup]:
    """Create a group under this process's own, limited unless ``limit_bytes`` is None.

    The group is removed afterwards. Processes still in it when the block ends are
    the caller's to end or move out first (:meth:`MemoryCgroup.kill_all`,
    :meth:`MemoryCgroup.move_out`): removal waits briefly for them to leave, then
    raises saying which group is left.
    """
    reason = can_nest_memory_cgroup()
    if reason is not None:
        raise OSError(f"cannot create a memory cgroup: {reason}")
    version, parent = _own_group()
    _sweep_orphans(parent)
    path = os.path.join(parent, name or f"hostmem-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(path)
    try:
        if limit_bytes is None:
            pass
        elif version == 1:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
        else:
            _write(os.path.join(path, "memory.max"), str(limit_bytes))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")  # a kill, not a swap storm
        yield MemoryCgroup(path=path, version=version, limit_bytes=limit_bytes)
    finally:
        _remove(path)


_ORPHAN = re.compile(r"hostmem-(?:guard-)?(\d+)-\d+")
_ORPHAN_AGE_S = 60.0  # younger groups stay: their pid may be a live process's of another pid namespace


def _sweep_orphans(parent: str) -> None:
    """Remove the empty groups ``memory_cgroup`` made under ``parent`` for a process that is
    gone (a guard ended by SIGKILL, as a CI runner's timeout ends it, could not remove
    its own). A group with processes in it, or whose maker still runs, stays: rmdir
    refuses the first, and the pid is checked for the second. A group made in the last
    minute stays too: its pid may be a live process's of another pid namespace beside
    this one, between making it and joining it."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    now = time.time()
    for name in names:
        found = _ORPHAN.fullmatch(name)
        if found is None or _alive(int(found.group(1))):
            continue
        path = os.path.join(parent, name)
        with contextlib.suppress(OSError):  # busy (processes in it), gone, or another sweep took it
            if now - os.stat(path).st_mtime < _ORPHAN_AGE_S:  # a maker in another pid namespace may be joining it
                continue
            os.rmdir(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove(path: str, wait_s: float = 5.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise OSError(f"{path}: could not remove the memory cgroup (processes still in it?)") from None
            time.sleep(0.05)
