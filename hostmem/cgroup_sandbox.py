"""A memory cgroup with a real limit, nested under this process's own cgroup.

Used to show a real kill: a child started inside the group is charged for what it
touches, and the kernel's OOM killer ends it when it goes over the limit. The group
is created under the cgroup the process is already in (from /proc/self/cgroup),
never beside it or at the root, and removed afterwards. Where the machine does not
allow it, :func:`can_nest_memory_cgroup` says why and nothing is created.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from .procfs import ProcReadError, memory_cgroup_dir

__all__ = ["MemoryCgroup", "can_nest_memory_cgroup", "memory_cgroup"]


@dataclass(frozen=True)
class MemoryCgroup:
    """A nested memory cgroup: where it is, which version, and how to put a process in."""

    path: str
    version: int
    limit_bytes: int

    @property
    def procs_file(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

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
def memory_cgroup(limit_bytes: int, name: str | None = None) -> Iterator[MemoryCgroup]:
    """Create a group with ``limit_bytes`` under this process's own; remove it afterwards.

    Processes still in the group when the block ends are the caller's to end first:
    removal waits briefly for them to leave, then raises saying which group is left.
    """
    reason = can_nest_memory_cgroup()
    if reason is not None:
        raise OSError(f"cannot create a memory cgroup: {reason}")
    version, parent = _own_group()
    path = os.path.join(parent, name or f"hostmem-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(path)
    try:
        if version == 1:
            _write(os.path.join(path, "memory.limit_in_bytes"), str(limit_bytes))
        else:
            _write(os.path.join(path, "memory.max"), str(limit_bytes))
            if os.path.exists(os.path.join(path, "memory.swap.max")):
                _write(os.path.join(path, "memory.swap.max"), "0")  # a kill, not a swap storm
        yield MemoryCgroup(path=path, version=version, limit_bytes=limit_bytes)
    finally:
        _remove(path)


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
