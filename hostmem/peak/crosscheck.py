"""Counters that cannot miss a spike, read beside the sampled peak.

A sampler can fall asleep for longer than a spike lives. Two kernel counters keep
their maximum by themselves, so the tracker reads them at start and at stop and
reports them beside its own figure, each saying what it counts:

- VmHWM, the process's high-water mark of resident memory, reset at start (``5``
  written to ``/proc/PID/clear_refs``). It counts *all* resident pages, file-backed
  and shmem included, so it bounds nothing about anonymous memory alone; but when it
  exceeds every RSS the sampler saw, a spike fell between two samples.
- The memory cgroup's peak (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``),
  which counts page cache and every process in the group and is not reset here
  (that would disturb anyone else reading it), so it only says something when it
  rose during tracking.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from ..procfs import ProcReadError, memory_cgroup_dir, proc_path, read_cgroup_v1_dir, read_cgroup_v2_dir, read_status
from ..units import format_size

__all__ = ["UNSEEN_TOLERANCE_BYTES", "CgroupPeak", "CrossChecks"]

# The kernel's RSS counters are per-CPU and read approximately, and RSS moves a little
# between two samples: VmHWM above the sampled RSS by less than this is counter noise.
UNSEEN_TOLERANCE_BYTES = 4 * 1024 * 1024

_hwm_owners: set[int] = set()  # pids whose VmHWM a running tracker in this process has reset


class CgroupPeak(NamedTuple):
    """The memory cgroup's own peak counter, read at start and at stop.

    It counts page cache and every process in the group, and hostmem does not reset
    it, so it says something about the tracked run only when it rose between start
    and stop (``rose``).
    """

    version: int
    path: str
    peak_at_start_bytes: int
    peak_bytes: int
    usage_at_start_bytes: int
    includes: str = "page cache and every process in the group; not reset at start"

    @property
    def rose(self) -> bool:
        return self.peak_bytes > self.peak_at_start_bytes

    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "path": self.path,
            "peak_bytes": self.peak_bytes,
            "peak_at_start_bytes": self.peak_at_start_bytes,
            "usage_at_start_bytes": self.usage_at_start_bytes,
            "rose": self.rose,
            "includes": self.includes,
        }


class CrossChecks:
    """VmHWM and the cgroup peak of one tracked run of ``pid``: ``begin``, then ``end``.

    Only one tracker in this process resets a given pid's VmHWM at a time (the first
    to begin); the others report ``hwm_bytes`` as None rather than a figure that a
    later reset cut short.
    """

    def __init__(self, pid: int, reset_hwm: bool):
        self.pid = pid
        self.reset_hwm = reset_hwm
        self.hwm_bytes: int | None = None
        self.cgroup: CgroupPeak | None = None
        self._owns_hwm = False
        self._cgroup_start: tuple | None = None

    def begin(self) -> None:
        """Read the cgroup peak and reset VmHWM; call just before the first sample."""
        self.hwm_bytes, self.cgroup = None, None
        self._cgroup_start = _cgroup_start(self.pid)
        self._owns_hwm = self.reset_hwm and _reset_hwm(self.pid)

    def end(self) -> None:
        """Read VmHWM and the cgroup peak again; call just after the last sample."""
        if self._owns_hwm:
            self.hwm_bytes = _read_hwm(self.pid)
        self.cgroup = _cgroup_stop(self._cgroup_start)
        self.release()

    def release(self) -> None:
        """Give up this pid's VmHWM, so that a later tracker may reset it again."""
        if self._owns_hwm:
            _hwm_owners.discard(self.pid)
            self._owns_hwm = False

    def unseen_rss_bytes(self, rss_peak_bytes: int) -> int | None:
        """How far VmHWM rose above every RSS sampled, beyond counter noise (0: nothing missed)."""
        if self.hwm_bytes is None or rss_peak_bytes < 0:
            return None
        unseen = self.hwm_bytes - rss_peak_bytes
        return unseen if unseen > UNSEEN_TOLERANCE_BYTES else 0

    def text(self, rss_peak_bytes: int) -> str:
        """What the counters say, and what they count."""
        parts = []
        if self.hwm_bytes is not None:
            unseen = self.unseen_rss_bytes(rss_peak_bytes) or 0
            parts.append(
                f"VmHWM {format_size(self.hwm_bytes)} (all resident pages, file-backed included"
                + (f"; {format_size(unseen)} above any sampled RSS: a spike fell between samples)" if unseen else ")")
            )
        if self.cgroup is not None:
            parts.append(
                f"memory cgroup v{self.cgroup.version} peak {format_size(self.cgroup.peak_bytes)} "
                f"({'rose during the run' if self.cgroup.rose else 'set before the run'}; counts "
                f"{self.cgroup.includes})"
            )
        return "; ".join(parts) if parts else "no cross-check available"


def _cgroup_start(pid: int) -> tuple | None:
    """(where, peak, usage) of the pid's memory cgroup, or None without a peak counter."""
    try:
        found = memory_cgroup_dir(pid)
        if found is None or not os.path.isdir(found[1]):
            return None
        reading = _read_cgroup(found)
    except (ProcReadError, OSError, ValueError):
        return None
    if reading.peak_bytes is None:
        return None
    return found, reading.peak_bytes, reading.usage_bytes


def _cgroup_stop(start: tuple | None) -> CgroupPeak | None:
    if start is None:
        return None
    found, peak_at_start, usage_at_start = start
    try:
        reading = _read_cgroup(found)
    except (ProcReadError, OSError, ValueError):
        return None
    if reading.peak_bytes is None:
        return None
    return CgroupPeak(found[0], found[1], peak_at_start, reading.peak_bytes, usage_at_start)


def _read_cgroup(found: tuple):
    version, folder, root = found
    return (read_cgroup_v1_dir if version == 1 else read_cgroup_v2_dir)(folder, root)


def _reset_hwm(pid: int) -> bool:
    """Reset VmHWM of ``pid`` unless another tracker here already did; True if we own it."""
    if pid in _hwm_owners:
        return False
    try:
        with open(proc_path(pid, "clear_refs"), "w") as handle:
            handle.write("5")
    except OSError:
        return False  # not permitted (another user's process) or a kernel without it
    _hwm_owners.add(pid)
    return True


def _read_hwm(pid: int) -> int | None:
    try:
        return read_status(pid).vm_hwm
    except ProcReadError:
        return None  # the process has exited
