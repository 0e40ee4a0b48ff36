"""Readers of /proc and of the memory cgroup, for this process or another.

Every reader takes a ``pid`` (``None`` means this process) and returns named
fields in bytes. A file that is missing or unreadable raises :class:`ProcReadError`,
which names the file and says what to do; readers that may legitimately find
nothing (a machine without a memory cgroup) return ``None`` and say so.

Everything is read here rather than through psutil: importing psutil costs more than
reading the few files a light command needs (``hostmem plan`` reads only meminfo), and
psutil exposes neither smaps' ``Locked`` and ``VmFlags`` nor ``/proc/PID/status``'s
``RssAnon``/``RssShmem``/``VmLck``, pagemap or cgroup files.

Modules, each with one job: ``files`` (the page size, paths, reading with errors that
name the file), ``maps`` (VMAs from maps and smaps), ``status`` (a process's status
counters and the machine's meminfo), ``stat`` (a process's state, parent and flags), ``io`` (its
bytes read from storage),
``mounts`` (which filesystem holds a path) and ``cgroup`` (the memory cgroup, v1 and v2). Names are imported on first use, so a
command that needs one reader does not pay for the others.
"""

from __future__ import annotations

from hostmem.lazy import lazy_exports

_EXPORTS = {
    "PAGE_SIZE": "files",
    "ProcReadError": "files",
    "proc_path": "files",
    "Vma": "maps",
    "read_maps": "maps",
    "read_smaps": "maps",
    "locked_within": "maps",
    "ProcStatus": "status",
    "parse_status": "status",
    "read_status": "status",
    "Meminfo": "status",
    "read_meminfo": "status",
    "parse_meminfo": "status",
    "ProcStat": "stat",
    "read_stat": "stat",
    "read_io_bytes": "io",
    "Mount": "mounts",
    "SHMEM_FS_TYPES": "mounts",
    "read_mounts": "mounts",
    "filesystem_of": "mounts",
    "is_shmem_fs": "mounts",
    "CgroupMemory": "cgroup",
    "memory_cgroup_dir": "cgroup",
    "read_cgroup_memory": "cgroup",
    "read_cgroup_v1_dir": "cgroup",
    "read_cgroup_v2_dir": "cgroup",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
