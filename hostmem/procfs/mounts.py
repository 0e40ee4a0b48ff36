"""The mounts a process sees, and which filesystem holds a path (tmpfs pages are shmem)."""

from __future__ import annotations

import os
from typing import NamedTuple

from .files import proc_path, read_text

__all__ = ["Mount", "SHMEM_FS_TYPES", "SHMEM_NAMES", "read_mounts", "parse_mountinfo", "filesystem_of", "is_shmem_fs"]

# Filesystems whose file pages are shmem: held in RAM, never reclaimable without swap.
SHMEM_FS_TYPES = frozenset({"tmpfs", "devtmpfs", "hugetlbfs", "ramfs", "shm"})
# Mapped areas whose pages are shmem (or, /dev/zero's private one, anonymous) by their name alone.
SHMEM_NAMES = ("/SYSV", "/memfd:", "/dev/zero", "[anon_shmem")


class Mount(NamedTuple):
    mount_point: str
    fs_type: str
    super_options: str
    root: str = "/"  # the folder of the filesystem mounted there (a container's own cgroup: /docker/<id>)
    device: int | None = None  # its superblock's device (MAJ:MIN): what /proc/locks names a file's by


def _unescape_mount(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def read_mounts(pid: int | None = None, path: str | None = None) -> list[Mount]:
    """Return the mounts the process sees, from /proc/PID/mountinfo (or the file ``path``)."""
    return parse_mountinfo(read_text(path or proc_path(pid, "mountinfo")))


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text: ``ID PARENT MAJ:MIN ROOT POINT OPTIONS ... - TYPE SOURCE SUPER``."""
    mounts = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        left_parts, right_parts = left.split(), right.split()
        if len(left_parts) < 5 or len(right_parts) < 1:
            continue
        mounts.append(
            Mount(
                mount_point=_unescape_mount(left_parts[4]),
                fs_type=right_parts[0],
                super_options=right_parts[2] if len(right_parts) > 2 else "",
                root=_unescape_mount(left_parts[3]),
                device=_device(left_parts[2]),
            )
        )
    return mounts


def _device(text: str) -> int | None:
    major, _, minor = text.partition(":")
    try:
        return os.makedev(int(major), int(minor))
    except ValueError:
        return None


def is_shmem_fs(path: str, mounts: list[Mount] | None = None) -> bool:
    """True when ``path`` lives on tmpfs or the like: its pages are shmem, not page cache."""
    mount = filesystem_of(path, mounts)
    return mount is not None and mount.fs_type in SHMEM_FS_TYPES


def filesystem_of(path: str, mounts: list[Mount] | None = None) -> Mount | None:
    """Return the mount that holds ``path`` (the longest matching mount point)."""
    mounts = read_mounts() if mounts is None else mounts
    resolved = os.path.realpath(path)
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point.rstrip("/") or "/"
        if resolved == point or resolved.startswith(point + "/") or point == "/":
            if best is None or len(point) >= len(best.mount_point.rstrip("/") or "/"):
                best = mount
    return best
