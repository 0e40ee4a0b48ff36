"""Live headroom: what this host can really give a deployment (``host.limit: auto``).

MemTotal is what the machine has, not what a server will get: other processes hold
memory the kernel cannot take back from them (their anonymous memory, shmem, locked
pages), and a memory cgroup caps the server whatever the host has free. So ``auto``
plans with the tighter of

- the host's headroom: ``MemAvailable`` (free memory plus the page cache and slab the
  kernel can reclaim: right for a planner, whose streamed weights are page cache too)
  plus what this process already holds itself, which its own plan counts;
- the cgroup's headroom: its limit (the tightest up the hierarchy this process can
  see, v1's ``hierarchical_memory_limit`` included) less what others in the group hold
  and cannot give back: the group's usage less its reclaimable file pages
  (active and inactive file in ``memory.stat``) less this process's share.

This process's share is RssAnon + RssShmem + VmLck (locked file pages are not
available either), at most VmRSS. ``hostmem plan`` reads them in its own process and
cgroup: run it where the server will run. Every figure is reported with its source.
"""

from __future__ import annotations

from typing import NamedTuple

from hostmem.units import format_size

__all__ = ["Figure", "Headroom", "headroom_of", "read_headroom"]


class Figure(NamedTuple):
    """One figure the headroom is made of, and where it was read."""

    name: str
    bytes: int
    source: str


class Headroom(NamedTuple):
    bytes: int
    source: str  # "MemAvailable" or "cgroup": which headroom is the tighter
    figures: tuple[Figure, ...]


def own_held(status) -> int:
    """What this process holds that is not available to others (see the module docstring)."""
    return min(status.vm_rss, status.rss_anon + status.rss_shmem + status.vm_lck)


def headroom_of(meminfo, status, cgroup) -> Headroom:
    """The headroom from /proc/meminfo, this process's status and its memory cgroup (or None)."""
    own = own_held(status)
    host = meminfo.available + own
    figures = [
        Figure("MemAvailable", meminfo.available, "/proc/meminfo: free memory and reclaimable page cache"),
        Figure("+ this process", own, "/proc/self/status: RssAnon + RssShmem + VmLck"),
        Figure("= host headroom", host, f"MemTotal {format_size(meminfo.total)} less "
               f"{format_size(max(0, meminfo.total - host))} others hold"),
    ]
    if cgroup is None or cgroup.limit_bytes is None:
        return Headroom(host, "MemAvailable", tuple(figures))
    usage = "memory.usage_in_bytes" if cgroup.version == 1 else "memory.current"
    others = max(0, cgroup.unreclaimable_bytes - own)
    group = max(0, cgroup.limit_bytes - others)
    figures += [
        Figure("cgroup limit", cgroup.limit_bytes, f"{cgroup.path} (v{cgroup.version}, tightest up the hierarchy)"),
        Figure("- others in the cgroup", others, f"{usage} less file pages (memory.stat) less this process"),
        Figure("= cgroup headroom", group, ""),
    ]
    if group < host:
        return Headroom(group, "cgroup", tuple(figures))
    return Headroom(host, "MemAvailable", tuple(figures))


def _fold_counters() -> None:
    """Fold the CPUs' pending memory counters into /proc/meminfo (root only; else skipped).

    The kernel batches them per CPU: a process that allocated a moment ago can be
    missing from MemAvailable for up to a second (vm.stat_interval).
    """
    try:
        with open("/proc/sys/vm/stat_refresh") as handle:
            handle.read()
    except OSError:
        pass


def read_headroom() -> Headroom:
    """The headroom of this process on this host, read now."""
    from hostmem.procfs import read_cgroup_memory, read_meminfo, read_status

    _fold_counters()
    return headroom_of(read_meminfo(), read_status(), read_cgroup_memory())
