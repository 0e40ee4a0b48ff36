"""Memory counters: a process's from /proc/PID/status, the machine's from /proc/meminfo."""

from __future__ import annotations

from typing import NamedTuple

from .files import ProcReadError, proc_path, read_text

__all__ = ["ProcStatus", "parse_status", "read_status", "Meminfo", "read_meminfo", "parse_meminfo"]


class ProcStatus(NamedTuple):
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
    return parse_status(read_text(path), path)


class Meminfo(NamedTuple):
    """Machine memory, in bytes, from /proc/meminfo (``cached`` counts reclaimable slab
    too, as ``free`` and psutil do)."""

    total: int
    available: int
    free: int
    cached: int
    shared: int


def read_meminfo() -> Meminfo:
    """Return MemTotal, MemAvailable, MemFree, Cached (+ SReclaimable) and Shmem."""
    fields_kib = parse_meminfo(read_text("/proc/meminfo"))
    free = fields_kib.get("MemFree", 0)
    return Meminfo(
        total=fields_kib.get("MemTotal", 0) * 1024,
        available=fields_kib.get("MemAvailable", free) * 1024,
        free=free * 1024,
        cached=(fields_kib.get("Cached", 0) + fields_kib.get("SReclaimable", 0)) * 1024,
        shared=fields_kib.get("Shmem", 0) * 1024,
    )


def parse_meminfo(text: str) -> dict[str, int]:
    """Return ``{field: kB}`` from the text of /proc/meminfo (``MemTotal: 123 kB``)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        value = rest.split()
        if value and value[0].isdigit():
            out[name.strip()] = int(value[0])
    return out
