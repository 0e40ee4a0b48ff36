"""A memory cgroup's page-cache, anonymous and limit-hit counters, v1 and v2 alike."""

from __future__ import annotations

import os

__all__ = ["cgroup_counters"]

# (page cache, anonymous) keys of memory.stat, by version
_KEYS = {1: ("cache", "rss"), 2: ("file", "anon")}


def _read_pairs(path: str) -> dict[str, int]:
    with open(path) as handle:
        return {k: int(v) for k, v in (line.split() for line in handle if line.count(" ") == 1)}


def cgroup_counters(path: str, version: int) -> dict[str, int]:
    """``cache``, ``anon`` (memory.stat), ``usage``, ``peak`` and ``limit_hits`` of the group at ``path``.

    ``limit_hits`` is how often the group's usage reached its limit (v1 ``memory.failcnt``,
    v2 ``max`` in memory.events): every hit made the kernel reclaim inside the group.
    """
    stat = _read_pairs(os.path.join(path, "memory.stat"))
    cache_key, anon_key = _KEYS[version]
    out = {"cache": stat.get(cache_key, 0), "anon": stat.get(anon_key, 0)}
    if version == 1:
        names = {"usage": "memory.usage_in_bytes", "peak": "memory.max_usage_in_bytes", "limit_hits": "memory.failcnt"}
        for key, name in names.items():
            with open(os.path.join(path, name)) as handle:
                out[key] = int(handle.read())
    else:
        with open(os.path.join(path, "memory.current")) as handle:
            out["usage"] = int(handle.read())
        peak = os.path.join(path, "memory.peak")
        if os.path.exists(peak):
            with open(peak) as handle:
                out["peak"] = int(handle.read())
        out["limit_hits"] = _read_pairs(os.path.join(path, "memory.events")).get("max", 0)
    return out
