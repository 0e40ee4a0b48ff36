"""A process's memory cgroup (v1 or v2): where it is, its limit, usage, peak and stat."""

from __future__ import annotations

import os
from collections import namedtuple
from typing import NamedTuple

from .files import ProcReadError, proc_path, read_text
from .mounts import read_mounts

__all__ = ["CgroupMemory", "memory_cgroup_dir", "read_cgroup_memory", "read_cgroup_v1_dir", "read_cgroup_v2_dir"]

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
    return CgroupMemory(
        version=version,
        path=directory,
        limit_bytes=_tightest(limits),
        usage_bytes=_read_int_or_none(os.path.join(directory, files.usage)) or 0,
        peak_bytes=_read_int_or_none(peak_file) if os.path.exists(peak_file) else None,
        stat=_read_stat(os.path.join(directory, "memory.stat")),
    )


def read_cgroup_v1_dir(directory: str, root: str | None = None) -> CgroupMemory:
    """Read a v1 memory cgroup folder (``memory.limit_in_bytes`` and friends)."""
    return _read_cgroup_dir(1, _V1_FILES, directory, root)


def read_cgroup_v2_dir(directory: str, root: str | None = None) -> CgroupMemory:
    """Read a v2 cgroup folder (``memory.max``, ``memory.current``, ``memory.peak``)."""
    return _read_cgroup_dir(2, _V2_FILES, directory, root)


def memory_cgroup_dir(pid: int | None = None) -> tuple[int, str, str] | None:
    """Return ``(version, folder, hierarchy_root)`` of the process's memory cgroup.

    v1 wins where a v1 memory controller is mounted (hybrid hosts keep memory there);
    ``None`` when the process is in no memory cgroup this machine exposes.
    """
    mounts = read_mounts(pid)
    lines = read_text(proc_path(pid, "cgroup")).splitlines()
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            for mount in mounts:
                if mount.fs_type == "cgroup" and "memory" in mount.super_options.split(","):
                    return 1, os.path.join(mount.mount_point, rel.lstrip("/")), mount.mount_point
    for line in lines:
        hierarchy, controllers, rel = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            for mount in mounts:
                if mount.fs_type == "cgroup2":
                    folder = os.path.join(mount.mount_point, rel.lstrip("/"))
                    if os.path.exists(os.path.join(folder, "memory.current")) or os.path.exists(
                        os.path.join(folder, "memory.max")
                    ):
                        return 2, folder, mount.mount_point
    return None


def read_cgroup_memory(pid: int | None = None) -> CgroupMemory | None:
    """Return the process's memory cgroup figures, or ``None`` where there is none."""
    found = memory_cgroup_dir(pid)
    if found is None:
        return None
    version, folder, root = found
    if not os.path.isdir(folder):
        return None
    reader = read_cgroup_v1_dir if version == 1 else read_cgroup_v2_dir
    return reader(folder, root)
