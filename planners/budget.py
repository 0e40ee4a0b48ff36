"""The host limit and the host budget.

The host budget is what pins may be paid from::

    budget = limit - reserve - committed non-reclaimable
                   - held back for pending adapter builds       (floored at 0)
             capped by max_pinned (less what is already pinned)

Committed is what the kernel cannot drop without swap: anonymous weights (a copy,
an in-place merge), their unmerge snapshots, shmem, pins already made, and, in a
live process, anonymous memory beyond the reserve that no weight explains. On a
unified-memory host (:mod:`planners.unified_memory`) the device plan's memory (its
reserve, the rest and the layers kept on the device, the prefetch window) is host
memory too, and is committed here once. The
reserve covers the process's own memory (Python, CUDA context, activations), so
only the part of the unexplained memory above it is charged.

Held back for pending adapter builds is what a merged combination being built in the
background (``lora_cache.set_adapters`` serving it at run time meanwhile) may still
allocate: one layer's output buffer and its fp32 sum
(``lora_cache.switching.adapter_switch.build_reserve_bytes``). It is not committed yet, so it
is a term of its own: pins planned now must leave it free, or the build's next layer
lands on a host the pins have already filled.

The reserve is configured (a size), the default, or measured from a warmup request
and remembered per deployment (``host.reserve: measured``, :mod:`planners.reserve`);
``reserve_source`` names which, and the report shows it.

The limit is configured (a host convention: a large machine can stand in for a
32 GiB one) or ``auto``: the live headroom (:mod:`planners.headroom`), the tighter of
MemAvailable and the memory cgroup's limit less what others hold and cannot give back,
since a cgroup charges page cache too and oversubscribing it gets the server killed.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from hostmem.errors import InputError
from hostmem.procfs import read_cgroup_memory, read_meminfo
from hostmem.residency_classes import Residency
from hostmem.units import format_size

from .config import DeploymentConfig
from .headroom import Headroom, read_headroom
from .unified_memory import UnifiedMemory, read_unified_memory

__all__ = ["HostLimit", "HostBudget", "resolve_host_limit", "read_host_limit", "host_budget"]


class HostLimit(NamedTuple):
    """The limit planned for, where it came from, and what this machine offers."""

    bytes: int
    source: str  # "config", a HOSTMEM_* variable, "MemAvailable" or "cgroup" (auto), "MemTotal"
    mem_total: int
    cgroup_limit: int | None
    headroom: Headroom | None = None  # auto: the figures the limit was made of, with their sources
    gpus: int | None = None  # GPUs this machine shows (None: not looked for)
    unified: UnifiedMemory | None = None  # whether device memory is host memory here (None: not looked for)

    @property
    def is_unified(self) -> bool:
        return self.unified is not None and self.unified.unified

    @property
    def machine_bytes(self) -> int:
        """What this machine can give: the tighter of MemTotal and the cgroup limit."""
        return min(self.mem_total, self.cgroup_limit) if self.cgroup_limit else self.mem_total


def resolve_host_limit(
    configured: int | None, mem_total: int, cgroup_limit: int | None, configured_source: str = "config",
    headroom: Headroom | None = None,
) -> HostLimit:
    """The configured limit, else (``None``) the live ``headroom``, else the tighter of
    MemTotal and the cgroup limit."""
    if configured is not None:
        return HostLimit(configured, configured_source, mem_total, cgroup_limit)
    if headroom is not None:
        return HostLimit(headroom.bytes, headroom.source, mem_total, cgroup_limit, headroom)
    if cgroup_limit is not None and cgroup_limit < mem_total:
        return HostLimit(cgroup_limit, "cgroup", mem_total, cgroup_limit)
    return HostLimit(mem_total, "MemTotal", mem_total, cgroup_limit)


def read_host_limit(config: DeploymentConfig) -> HostLimit:
    """Resolve the config's host limit against this machine's /proc/meminfo and cgroup.

    A reserve at or above a configured limit, or at or above what the machine has
    (``auto``), is a config error; at or above the live headroom only, it is the plan's
    verdict (it does not fit now).
    """
    cgroup = read_cgroup_memory()
    meminfo = read_meminfo()
    source = config.origin.overrides.get("host.limit", "config")
    headroom = read_headroom() if config.host.limit is None else None
    limit = resolve_host_limit(
        config.host.limit, meminfo.total, cgroup.limit_bytes if cgroup else None, source, headroom
    )
    limit = limit._replace(gpus=count_gpus(), unified=read_unified_memory())
    # auto: a reserve above what the machine has is an error; above what is free now, the verdict
    ceiling, named = (limit.bytes, limit.source) if headroom is None else (
        limit.machine_bytes, "cgroup" if limit.machine_bytes != limit.mem_total else "MemTotal")
    if config.host.reserve >= ceiling:
        raise config.origin.error(
            "host.reserve",
            f"{format_size(config.host.reserve)} is not below the host limit of {format_size(ceiling)} "
            f"({named}); lower the reserve or configure host.limit",
        )
    return limit


def count_gpus(dev: str = "/dev") -> int:
    """GPUs this machine shows (NVIDIA's /dev/nvidiaN, AMD's /dev/kfd), without importing torch."""
    try:
        names = os.listdir(dev)
    except OSError:
        return 0
    return sum(1 for n in names if n.startswith("nvidia") and n[6:].isdigit()) + ("kfd" in names)


class HostBudget(NamedTuple):
    """Each term of the budget, in bytes; ``bytes`` is what pins may use."""

    limit: int
    reserve: int
    max_pinned: int
    committed_anonymous: int = 0
    committed_shmem: int = 0
    committed_pinned: int = 0
    process_excess: int = 0
    build_reserve: int = 0  # held back for pending adapter builds (not committed yet)
    reserve_source: str = "config"  # where the reserve came from (a measured one says when: planners.reserve)
    committed_device: int = 0  # the device plan's memory, on a unified-memory host (planners.unified_memory)

    @property
    def committed(self) -> int:
        return (self.committed_anonymous + self.committed_shmem + self.committed_pinned + self.process_excess
                + self.committed_device)

    @property
    def room(self) -> int:
        """Memory left for new pins and page cache together (floored at 0)."""
        return max(0, self.limit - self.reserve - self.committed - self.build_reserve)

    @property
    def pin_cap(self) -> int:
        """How much more may be pinned under ``max_pinned``."""
        return max(0, self.max_pinned - self.committed_pinned)

    @property
    def bytes(self) -> int:
        return min(self.room, self.pin_cap)


def host_budget(
    limit: int, reserve: int, max_pinned: int, committed: Residency, process_excess: int = 0,
    build_reserve: int = 0, reserve_source: str = "config", device: int = 0,
) -> HostBudget:
    """The budget of a host whose non-reclaimable memory is ``committed``, holding
    ``build_reserve`` back for pending adapter builds; ``device``: what the device plan
    allocates, on a host whose device memory is host memory (0 elsewhere)."""
    if build_reserve < 0:
        raise InputError(f"host_budget: build_reserve {build_reserve} must not be negative")
    return HostBudget(
        limit=limit,
        reserve=reserve,
        max_pinned=max_pinned,
        committed_anonymous=committed.anonymous,
        committed_shmem=committed.shmem,
        committed_pinned=committed.pinned,
        process_excess=max(0, process_excess),
        build_reserve=build_reserve,
        reserve_source=reserve_source,
        committed_device=device,
    )
