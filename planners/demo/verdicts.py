"""The demo's verdicts: the plan's, for the merge each scenario starts with, beside what was measured.

A scenario's verdict is what ``hostmem plan CONFIG --what-if MERGE`` says on the demo's
own config (``base``: none, ``in_place``: in-place, the cached starts: cached), so the
demo and the planner never disagree about the same deployment. The measurement (the
peak of anonymous memory, and where a real memory cgroup ran, whether the kernel killed
the start) is printed next to it, and a start that survived where the plan says it is
killed at the first request is explained: the demo's start serves no request, so it
never allocates the reserve's activations.
"""

from __future__ import annotations

from hostmem.units import format_size

__all__ = ["SCENARIO_MERGES", "plan_verdicts", "verdict_lines"]

SCENARIO_MERGES = {"base": "none", "in_place": "in-place", "cached_miss": "cached", "cached_hit": "cached"}


def plan_verdicts(config_path: str) -> dict[str, dict]:
    """``{scenario: {"merge", "fits", "verdict"}}`` from the plan of the demo's config."""
    from planners.plan_build import build_plan
    from planners.config import load_config

    config = load_config(config_path)
    by_merge = {merge: build_plan(config, merge) for merge in set(SCENARIO_MERGES.values())}
    return {name: {"merge": merge, "fits": by_merge[merge].fits, "verdict": by_merge[merge].verdict.line}
            for name, merge in SCENARIO_MERGES.items()}


def _measured(demo, s) -> str:
    cgroup = demo.cgroup or {}
    measured = cgroup.get(s.name)
    if measured is not None:
        real = f"a real {format_size(cgroup['limit_bytes'])} memory cgroup"
        return (f"killed by the kernel (OOM) under {real}, peak anon {format_size(measured['peak_anon_bytes'])}"
                if measured["killed"] else
                f"survived {real}, peak anon {format_size(measured['peak_anon_bytes'])}")
    return f"peak anon {format_size(s.peak_anon_bytes)} of {format_size(demo.host_limit_bytes)}"


def verdict_lines(demo, labels: dict[str, str]) -> list[str]:
    """One line per scenario: the plan's verdict, then what was measured."""
    cgroup = demo.cgroup or {}
    lines = [f"verdict on a {format_size(demo.host_limit_bytes)} host (the plan's: hostmem plan CONFIG --what-if "
             "MERGE on the demo's config), and what was measured:"]
    for s in demo.scenarios:
        said = (demo.verdicts or {}).get(s.name)
        verdict = said["verdict"] if said else "fits: unknown (not planned)"
        lines.append(f"  {labels[s.name]}: {verdict}")
        measured = _measured(demo, s)
        survived = not (cgroup.get(s.name) or {}).get("killed") and s.peak_anon_bytes <= demo.host_limit_bytes
        why = (" (the start served no request, so it never allocated what the reserve holds for one)"
               if said and not said["fits"] and survived and "first request" in verdict else "")
        lines.append(f"      measured: {measured}{why}")
    if "skipped" in cgroup:
        lines.append(f"  (no real memory cgroup here: {cgroup['skipped']}; measured peaks only)")
    elif not cgroup:
        lines.append("  (--cgroup runs scenarios 2 and 4 under a real memory cgroup at the limit)")
    return lines
