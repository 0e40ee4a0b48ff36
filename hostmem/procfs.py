"""Readers of /proc and of the memory cgroup, for this process or another.

Every reader takes a ``pid`` (``None`` means this process) and returns named
fields in bytes. A file that is missing or unreadable raises :class:`ProcReadError`,
which names the file and says what to do; readers that may legitimately find
nothing (a machine without a memory cgroup) return ``None`` and say so.

psutil parses ``/proc/meminfo`` and the process tree, so those come from it.
It does not expose smaps' ``Locked`` and ``VmFlags``, ``/proc/PID/status``'s
``RssAnon``/``RssShmem``/``VmLck``, pagemap or cgroup files, so those are read here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil

__all__ = [
    "ProcReadError",
    "Vma",
    "ProcStatus",
    "Meminfo",
    "CgroupMemory",
    "Mount",
    "proc_path",
    "read_maps",
    "read_smaps",
    "read_status",
    "read_meminfo",
    "read_mounts",
    "filesystem_of",
    "is_shmem_fs",
    "SHMEM_FS_TYPES",
    "read_cgroup_memory",
    "read_cgroup_v1_dir",
    "read_cgroup_v2_dir",
]

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Filesystems whose file pages are shmem: held in RAM, never reclaimable without swap.
SHMEM_FS_TYPES = frozenset({"tmpfs", "devtmpfs", "hugetlbfs", "ramfs", "shm"})
_UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE, near 2**63


class ProcReadError(OSError):
    """A /proc or cgroup file could not be read; the message names the file."""


def proc_path(pid: int | None, name: str) -> str:
    """Return ``/proc/<pid>/<name>`` (``/proc/self/<name>`` when ``pid`` is None)."""
    return f"/proc/{'self' if pid is None else int(pid)}/{name}"


def _read_text(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except FileNotFoundError:
        raise ProcReadError(
            f"{path}: not found (the process may have exited, or this is not Linux)"
        ) from None
    except PermissionError:
        raise ProcReadError(
            f"{path}: permission denied (run as the process's user or as root)"
        ) from None
    except OSError as exc:
        raise ProcReadError(f"{path}: {exc.strerror or exc}") from None


@dataclass(frozen=True)
class Vma:
    """One virtual memory area from /proc/PID/smaps. Sizes are bytes."""

    start: int
    end: int
    perms: str
    offset: int
    inode: int
    path: str | None
    rss: int = 0
    anonymous: int = 0
    locked: int = 0
    swap: int = 0
    anon_huge_pages: int = 0  # of ``anonymous``, what transparent huge pages hold
    shmem_pmd_mapped: int = 0
    private_dirty: int = 0
    vm_flags: frozenset = field(default_factory=frozenset)

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_shared(self) -> bool:
        """True for MAP_SHARED areas ('s' in the permissions)."""
        return self.perms[3:4] == "s"

    @property
    def is_locked(self) -> bool:
        """True when the area is mlocked (VmFlags ``lo``)."""
        return "lo" in self.vm_flags

    @property
    def is_file(self) -> bool:
        """True when the area maps a file (an inode), not anonymous memory."""
        return self.inode != 0


_SMAPS_FIELDS = {
    "Rss": "rss",
    "Anonymous": "anonymous",
    "Locked": "locked",
    "Swap": "swap",
    "AnonHugePages": "anon_huge_pages",
    "ShmemPmdMapped": "shmem_pmd_mapped",
    "Private_Dirty": "private_dirty",
}


def _parse_vma_header(line: str) -> dict:
    parts = line.split(None, 5)
    start, end = (int(x, 16) for x in parts[0].split("-"))
    path = parts[5].strip() if len(parts) > 5 else None
    return {
        "start": start,
        "end": end,
        "perms": parts[1],
        "offset": int(parts[2], 16),
        "inode": int(parts[4]),
        "path": path or None,
    }


def read_maps(pid: int | None = None) -> list[Vma]:
    """Return every VMA of the process from /proc/PID/maps: ranges, permissions, paths.

    Much cheaper than smaps (the kernel does not walk the pages to count Rss), but
    without counters or VmFlags.
    """
    path = proc_path(pid, "maps")
    return [Vma(**_parse_vma_header(line)) for line in _read_text(path).splitlines() if line]


def read_smaps(pid: int | None = None) -> list[Vma]:
    """Return every VMA of the process with its smaps fields, in address order."""
    path = proc_path(pid, "smaps")
    vmas: list[Vma] = []
    current: dict | None = None
    for line in _read_text(path).splitlines():
        head = line.split(":", 1)[0]
        if head == "VmFlags":
            if current is not None:
                current["vm_flags"] = frozenset(line.split(":", 1)[1].split())
        elif ":" in line and " " not in head and head[:1].isalpha() and not _looks_like_range(head):
            key = _SMAPS_FIELDS.get(head)
            if key is not None and current is not None:
                current[key] = int(line.split()[1]) * 1024
        else:
            if current is not None:
                vmas.append(Vma(**current))
            current = _parse_vma_header(line)
    if current is not None:
        vmas.append(Vma(**current))
    return vmas


def _looks_like_range(token: str) -> bool:
    return "-" in token and all(c in "0123456789abcdef-" for c in token)


@dataclass(frozen=True)
class ProcStatus:
    """Memory lines of /proc/PID/status, in bytes."""

    rss_anon: int
    rss_file: int
    rss_shmem: int
    vm_rss: int
    vm_hwm: int
    vm_lck: int
    vm_pin: int

    @property
    def non_reclaimable(self) -> int:
        """Anonymous plus shmem: what the kernel cannot drop without swap."""
        return self.rss_anon + self.rss_shmem


_STATUS_FIELDS = {
    "RssAnon": "rss_anon",
    "RssFile": "rss_file",
    "RssShmem": "rss_shmem",
    "VmRSS": "vm_rss",
    "VmHWM": "vm_hwm",
    "VmLck": "vm_lck",
    "VmPin": "vm_pin",
}


def parse_status(text: str, source: str = "/proc/PID/status") -> ProcStatus:
    """Parse the text of a status file; ``source`` names it in errors."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        name = _STATUS_FIELDS.get(key)
        if name:
            values[name] = int(rest.split()[0]) * 1024
    missing = [k for k, v in _STATUS_FIELDS.items() if v not in values]
    if missing:
        raise ProcReadError(
            f"{source}: no {', '.join(missing)} line (a kernel older than 4.5, or a zombie process)"
        )
    return ProcStatus(**values)


def read_status(pid: int | None = None) -> ProcStatus:
    """Return RssAnon, RssFile, RssShmem, VmRSS, VmHWM, VmLck and VmPin of a process."""
    path = proc_path(pid, "status")
    return parse_status(_read_text(path), path)


@dataclass(frozen=True)
class Meminfo:
    """Machine memory, in bytes (from psutil's reading of /proc/meminfo)."""

    total: int
    available: int
    free: int
    cached: int
    shared: int


def read_meminfo() -> Meminfo:
    """Return MemTotal, MemAvailable, MemFree, Cached and Shmem."""
    vm = psutil.virtual_memory()
    return Meminfo(
        total=int(vm.total),
        available=int(vm.available),
        free=int(vm.free),
        cached=int(getattr(vm, "cached", 0)),
        shared=int(getattr(vm, "shared", 0)),
    )


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fs_type: str
    super_options: str


def _unescape_mount(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def read_mounts(pid: int | None = None) -> list[Mount]:
    """Return the mounts the process sees, from /proc/PID/mountinfo."""
    path = proc_path(pid, "mountinfo")
    mounts = []
    for line in _read_text(path).splitlines():
        left, _, right = line.partition(" - ")
        left_parts, right_parts = left.split(), right.split()
        if len(left_parts) < 5 or len(right_parts) < 1:
            continue
        mounts.append(
            Mount(
                mount_point=_unescape_mount(left_parts[4]),
                fs_type=right_parts[0],
                super_options=right_parts[2] if len(right_parts) > 2 else "",
            )
        )
    return mounts


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


@dataclass(frozen=True)
class CgroupMemory:
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
    text = _read_text(path).strip()
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ProcReadError(f"{path}: expected a number or 'max', found {text[:40]!r}") from None
    return None if value >= _UNLIMITED_V1 else value


def _read_stat(path: str) -> dict[str, int]:
    stat = {}
    for line in _read_text(path).splitlines():
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


@dataclass(frozen=True)
class _CgroupFiles:
    limit: str
    usage: str
    peak: str


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
    lines = _read_text(proc_path(pid, "cgroup")).splitlines()
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
