"""The host section of the text report: the limit and where it came from, the budget.

On a unified-memory host (:mod:`planners.unified_memory`) the report says so and
why, and the device plan's memory is a row of the budget.
``limit: auto`` lists each figure of the live headroom with the file it was read from;
a rank sharing its host says its share; pending adapter builds show their row only
while one is pending.
"""

from __future__ import annotations

from hostmem.table import format_table
from hostmem.units import format_size

__all__ = ["host_lines"]


def host_lines(plan) -> list[str]:
    h, b = plan.host, plan.budget
    cgroup = format_size(h.cgroup_limit) if h.cgroup_limit else "none"
    return [
        f"host: limit {format_size(h.bytes)} ({h.source}); MemTotal {format_size(h.mem_total)}; "
        f"cgroup limit {cgroup}",
        *_headroom_lines(h.headroom),
        *([f"unified memory: yes ({h.unified.source})"] if h.is_unified else []),
        *(_host_share_lines(plan.host_share) if plan.host_share else []),
        "budget:",
        *format_table([
            ("limit", format_size(b.limit), ""),
            ("- reserve", format_size(b.reserve), f"({b.reserve_source.split(':')[0]})"),
            ("- committed anonymous", format_size(b.committed_anonymous), ""),
            ("- committed shmem", format_size(b.committed_shmem), ""),
            ("- committed pinned", format_size(b.committed_pinned), ""),
            ("- process beyond reserve", format_size(b.process_excess), ""),
            *_device_rows(h, b),
            *_build_reserve_rows(b),
            ("= room (pins + page cache)", format_size(b.room), ""),
            ("max pinned", format_size(b.max_pinned), ""),
            ("budget for pins", format_size(b.bytes), "(room, capped by max pinned)"),
        ], indent="  "),
        *_build_reserve_lines(b),
        *([f"  reserve {b.reserve_source}"] if ":" in b.reserve_source else []),
    ]


def _headroom_lines(headroom) -> list[str]:
    """``limit: auto``: each figure of the live headroom and where it was read."""
    if headroom is None:
        return []
    lines = format_table([(f.name, format_size(f.bytes)) for f in headroom.figures], indent="    ")
    return [f"  limit auto = the {'cgroup' if headroom.source == 'cgroup' else 'host'} headroom, the tighter of:",
            *(f"{line}  {f.source}".rstrip() for line, f in zip(lines, headroom.figures))]


def _build_reserve_rows(budget) -> list[tuple[str, str, str]]:
    """The budget row of pending adapter builds, present only while one is pending."""
    if not budget.build_reserve:
        return []
    return [("- pending adapter builds", format_size(budget.build_reserve), "(see below)")]


def _build_reserve_lines(budget) -> list[str]:
    """Why the pending adapter builds are held back, present only while one is pending."""
    if not budget.build_reserve:
        return []
    return [f"  held back {format_size(budget.build_reserve)} for pending adapter builds: a combination served at "
            "run time is being merged in the background, and its next weight tensor's output and fp32 sum "
            "must find room"]


def _host_share_lines(share) -> list[str]:
    """This rank's part of the host budget: its pins are capped at that share."""
    alike = "; ranks taken to be alike: equal shares" if "no process group" in share["source"] else ""
    return [f"host share: local rank {share['local_rank']} of {share['local_world_size']} (from {share['source']}"
            f"{alike})",
            f"  {format_size(share['share_bytes'])} of the host budget {format_size(share['host_budget_bytes'])}, "
            f"split by need ({', '.join(format_size(s) for s in share['shares_bytes'])}); pins capped at this share",
            *_rank_lines(share)]


def _rank_lines(share) -> list[str]:
    """A planned host's ranks (:mod:`planners.rank_plan`): each rank's part, and the host's sums."""
    if "host_limit_bytes" not in share:
        return []
    n = share["local_world_size"]
    parts = ", ".join(f"{name} {format_size(b)}" for name, b in share["parts_bytes"].items())
    return [f"  each rank: limit {format_size(share['limit_per_rank_bytes'])} (host limit "
            f"{format_size(share['host_limit_bytes'])} / {n}), reserve {format_size(share['reserve_per_rank_bytes'])}, "
            f"committed {format_size(share['committed_per_rank_bytes'])}",
            f"  host: committed {n} x {format_size(share['committed_per_rank_bytes'])} = "
            f"{format_size(share['host_committed_bytes'])}, reserve {n} x {format_size(share['reserve_per_rank_bytes'])}"
            f" = {format_size(share['host_reserve_bytes'])}",
            *([f"  tensor parallel {share['tensor_parallel']}: each rank holds {parts} (its part)"] if parts else [])]


def _device_rows(host, budget) -> list[tuple[str, str, str]]:
    """On a unified-memory host, the device plan's memory is a term of the host budget."""
    if not host.is_unified:
        return []
    return [("- device plan (unified memory)", format_size(budget.committed_device),
             "(device reserve, kept layers, window: host memory here, counted once)")]
