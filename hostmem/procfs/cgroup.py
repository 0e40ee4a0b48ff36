"""A process's memory cgroup (v1 or v2): where it is, its limit, usage, peak and stat.

Where it is: ``/proc/PID/cgroup`` names the group's path from its hierarchy's root,
and mountinfo says which folder of that hierarchy each mount shows (its root field).
On a host both are ``/``; in a container on cgroup v1 without a cgroup namespace the
process reads ``/docker/<id>`` while the hierarchy is mounted from ``/docker/<id>``, so
its own group is the mount point itself. Joining the two paths without the root field
names a folder that does not exist, and a capped container would plan as the host.
"""

from __future__ import annotations

import os
from collections import namedtuple
from typing import NamedTuple

from .files import ProcReadError, proc_path, read_text
from .mounts import Mount, read_mounts

__all__ = ["CgroupMemory", "memory_cgroup_dir", "read_cgroup_memory", "read_cgroup_v1_dir", "read_cgroup_v2_dir",
           "folder_in_mount"]

_UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE, near 2**63


class CgroupMemory(NamedTuple):
    """A process's memory cgroup. ``None`` fields mean "no limit" or "not offered".

    ``limit_bytes`` is the tightest limit on the path from the group up to the
    hierarchy's root that this process can read. ``usage_bytes`` and ``peak_bytes``
    include page cache charged to the group, as the kernel counts them.
    """

    version: int
    path: str
    limit_bytes: int | None
    usage_bytes: int
    peak_bytes: int | None
    stat: dict[str, int]

    @property
    def reclaimable_bytes(self) -> int:
        """File pages charged to the group that the kernel can drop (active + inactive file).

        shmem sits on the anonymous lists, so it is not counted here: it is not reclaimable
        without swap. v1 gives the group's subtree as ``total_*``; v2's figures are the subtree's.
        """
        stat = self.stat
        if "total_inactive_file" in stat:
            return stat["total_inactive_file"] + stat.get("total_active_file", 0)
        return stat.get("inactive_file", 0) + stat.get("active_file", 0)

    @property
    def unreclaimable_bytes(self) -> int:
        """What the group holds that the kernel cannot drop: usage less reclaimable file pages."""
        return max(0, self.usage_bytes - self.reclaimable_bytes)


def _read_int_or_none(path: str) -> int | None:
    """Read a cgroup number; ``max`` (v2) and near-2**63 (v1) mean no limit."""
    text = read_text(path).strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ProcReadError(f"{path}: expected a number or 'max', found {text[:40]!r}") from None
    return None if value >= _UNLIMITED_V1 else value


def _read_stat(path: str) -> dict[str, int]:
    stat = {}
    for line in read_text(path).splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            stat[parts[0]] = int(parts[1])
    return stat


def _tightest(limits: list[int | None]) -> int | None:
    present = [x for x in limits if x is not None]
    return min(present) if present else None


def _ancestors(directory: str, root: str) -> list[str]:
    chain, current = [], os.path.normpath(directory)
    root = os.path.normpath(root)
    while True:
        chain.append(current)
        if current == root or len(current) <= len(root):
            return chain
        current = os.path.dirname(current)


_CgroupFiles = namedtuple("_CgroupFiles", "limit usage peak")  # the file names of one cgroup version


_V1_FILES = _CgroupFiles("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes")
_V2_FILES = _CgroupFiles("memory.max", "memory.current", "memory.peak")


def _read_cgroup_dir(version: int, files: _CgroupFiles, directory: str, root: str | None) -> CgroupMemory:
    limits = [
        _read_int_or_none(os.path.join(d, files.limit))
        for d in _ancestors(directory, root or directory)
        if os.path.exists(os.path.join(d, files.limit))
    ]
    peak_file = os.path.join(directory, files.peak)
    stat_file = os.path.join(directory, "memory.stat")
    stat = _read_stat(stat_file) if os.path.exists(stat_file) else {}
    # v1 also states the limit of ancestors a container cannot see (above its mount)
    hierarchical = stat.get("hierarchical_memory_limit")
    limits.append(None if hierarchical is None or hierarchical >= _UNLIMITED_V1 else hierarchical)
    return CgroupMemory(
        version=version,
        path=directory,
        limit_bytes=_tightest(limits),
        usage_bytes=_read_int_or_none(os.path.join(directory, files.usage)) or 0,
        peak_bytes=_read_int_or_none(peak_file) if os.path.exists(peak_file) else None,
        stat=stat,
    )


def read_cgroup_v1_dir(directory: str, root: str | None = None) -> CgroupMemory:
    """Read a v1 memory cgroup folder (``memory.limit_in_bytes`` and friends)."""
    return _read_cgroup_dir(1, _V1_FILES, directory, root)


def read_cgroup_v2_dir(directory: str, root: str | None = None) -> CgroupMemory:
    """Read a v2 cgroup folder (``memory.max``, ``memory.current``, ``memory.peak``)."""
    return _read_cgroup_dir(2, _V2_FILES, directory, root)


def folder_in_mount(mount: Mount, group: str) -> str | None:
    """The folder of cgroup path ``group`` (as /proc/PID/cgroup names it) under ``mount``.

    The mount shows its hierarchy from ``mount.root`` down; ``None`` when ``group`` lies
    outside what it shows.
    """
    root = "/" + mount.root.strip("/")
    group = "/" + group.strip("/")
    if root == "/":
        inner = group
    elif group == root or group.startswith(root + "/"):
        inner = group[len(root):]
    else:
        return None
    return os.path.join(mount.mount_point, inner.lstrip("/")).rstrip("/") or "/"


def _found(version: int, mounts: list[Mount], group: str, wanted) -> tuple[int, str, str] | None:
    """The first mount of the wanted kind that shows ``group`` as an existing folder."""
    candidates = [(m, folder_in_mount(m, group)) for m in mounts if wanted(m)]
    shown = [(m, f) for m, f in candidates if f is not None]
    for mount, folder in shown:
        if os.path.isdir(folder):
            return version, folder, mount.mount_point
    return (version, shown[0][1], shown[0][0].mount_point) if shown else None


def memory_cgroup_dir(pid: int | None = None, proc_dir: str | None = None) -> tuple[int, str, str] | None:
    """Return ``(version, folder, hierarchy_root)`` of the process's memory cgroup.

    v1 wins where a v1 memory controller is mounted (hybrid hosts keep memory there);
    ``None`` when the process is in no memory cgroup this machine exposes.
    ``proc_dir`` reads ``cgroup`` and ``mountinfo`` from that folder instead of
    /proc/PID (a container's files, kept for a test or a report).
    """
    cgroup_file = os.path.join(proc_dir, "cgroup") if proc_dir else proc_path(pid, "cgroup")
    mounts = read_mounts(pid, os.path.join(proc_dir, "mountinfo") if proc_dir else None)
    lines = [line for line in read_text(cgroup_file).splitlines() if line.count(":") >= 2]
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            found = _found(1, mounts, rel, lambda m: m.fs_type == "cgroup" and "memory" in m.super_options.split(","))
            if found is not None:
                return found
    for line in lines:
        hierarchy, controllers, rel = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            found = _found(2, mounts, rel, lambda m: m.fs_type == "cgroup2")
            if found is not None and (os.path.exists(os.path.join(found[1], "memory.current"))
                                      or os.path.exists(os.path.join(found[1], "memory.max"))):
                return found
    return None


def read_cgroup_memory(pid: int | None = None, proc_dir: str | None = None) -> CgroupMemory | None:
    """Return the process's memory cgroup figures, or ``None`` where there is none."""
    found = memory_cgroup_dir(pid, proc_dir)
    if found is None:
        return None
    version, folder, root = found
    if not os.path.isdir(folder):
        return None
    reader = read_cgroup_v1_dir if version == 1 else read_cgroup_v2_dir
    return reader(folder, root)
