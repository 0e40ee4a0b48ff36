"""The startup report: text for people, JSON for machines.

The JSON form is a contract: sizes are bytes, times are seconds, and keys may be
added but never renamed::

    {"deployment": str, "mode": "what-if" | "live", "merge": "none" | "in-place" | "cached",
     "host": {"limit_bytes", "source", "mem_total_bytes", "cgroup_limit_bytes"},
     "budget": {"bytes", "reserve_bytes", "committed_bytes", "limit_bytes", "room_bytes",
                "max_pinned_bytes", "pin_cap_bytes", "build_reserve_bytes",
                "committed": {"anonymous_bytes", "shmem_bytes", "pinned_bytes", "process_excess_bytes"}},
     "components": {NAME: {"anonymous", "file_backed", "pinned", "total", "shmem", "swapped",
                           "not_resident", "non_reclaimable", "weights_bytes", "extra_anonymous",
                           "lora_target_bytes", "layers", "offload", "source"}},
     "device_plan": {"component", "resident_layers": [..], "streamed_layers": [..], "vram_bytes",
                     "reserve_bytes", "rest_bytes", "window_bytes", "resident_bytes",
                     "streamed_bytes", "fits"},
     "pin_plans": {NAME: {"pinned_bytes", "pinned_layers": [..], "transfer_s_per_request",
                          "baseline_transfer_s_per_request", "net_cost_bytes", "moves_per_request",
                          "candidate_layers", "page_cache_bytes", "page_cache_fits",
                          "disk_bytes_per_request"}},
     "transfer_s_per_request", "baseline_transfer_s_per_request",
     "offers": [{"provider", "component", "anonymous_bytes", "disk_bytes", "one_time_s", "note",
                 "budget_bytes", "pinned_bytes", "transfer_s_per_request"}],
     "warnings": [str], "notes": [str],
     "merge_reason": str,
     "alternatives": [{"label", "merge", "budget_bytes", "committed_bytes", "pinned_bytes",
                       "pinned_layers": {NAME: [..]}, "transfer_s_per_request", "over_limit_bytes"}],
     "lora_merge": null | {"layers", "hit", "built", "fallen_back", "in_place", "bytes",
                           "bytes_written", "seconds", "rate_bytes_per_s", "cache_key",
                           "cache_root", "adapters"},
     "host_share": null | {"local_rank", "local_world_size", "source", "host_budget_bytes",
                           "share_bytes", "shares_bytes", "needs_bytes"}}

A component's ``total`` is every byte it holds: its weights plus ``extra_anonymous``
(an unmerge snapshot). ``cgroup_limit_bytes`` is null where no cgroup limits memory.
``merge_reason`` says why the plan merges as it does (empty without adapters).
``alternatives`` plans the same deployment another way beside this plan: a cached
merge is shown next to the in-place merge it replaces ("without the LoRA merge
cache"), so the budget the cache gives back reads off one report. ``lora_merge`` is
what ``lora_cache.merge`` did (a live plan given ``merge_stats``), null otherwise.
``host_share`` is this rank's part of a host budget split across the ranks of one
host (:mod:`planners.host_share`), null for the only rank on its host.
``build_reserve_bytes`` is held back from the room for adapter combinations being built
in the background (:mod:`planners.budget`), 0 when none is; the text shows its line
only then.
"""

from __future__ import annotations

import re

from hostmem.table import format_table
from hostmem.units import format_rate, format_size

from .deployment import DeploymentPlan
from .sizes import REST

__all__ = ["report_dict", "report_text", "compress_names"]


def _components(plan: DeploymentPlan) -> dict:
    out = {}
    for name, sizes in plan.components.items():
        r = sizes.residency
        out[name] = {
            "anonymous": r.anonymous,
            "file_backed": r.file_backed,
            "pinned": r.pinned,
            "total": r.total,
            "shmem": r.shmem,
            "swapped": r.swapped,
            "not_resident": r.not_resident,
            "non_reclaimable": r.non_reclaimable,
            "weights_bytes": sizes.weights_bytes,
            "extra_anonymous": sizes.extra.anonymous,
            "lora_target_bytes": sizes.lora_target_bytes,
            "layers": len(sizes.layers),
            "offload": sizes.offload,
            "source": sizes.source,
        }
    return out


def _budget(plan: DeploymentPlan) -> dict:
    b = plan.budget
    return {
        "bytes": b.bytes,
        "reserve_bytes": b.reserve,
        "committed_bytes": b.committed,
        "limit_bytes": b.limit,
        "room_bytes": b.room,
        "max_pinned_bytes": b.max_pinned,
        "pin_cap_bytes": b.pin_cap,
        "build_reserve_bytes": b.build_reserve,
        "committed": {
            "anonymous_bytes": b.committed_anonymous,
            "shmem_bytes": b.committed_shmem,
            "pinned_bytes": b.committed_pinned,
            "process_excess_bytes": b.process_excess,
        },
    }


def _device(plan: DeploymentPlan) -> dict:
    d = plan.device
    return {
        "component": d.component,
        "resident_layers": list(d.resident_layers),
        "streamed_layers": list(d.streamed_layers),
        "vram_bytes": d.vram,
        "reserve_bytes": d.reserve,
        "rest_bytes": d.rest_bytes,
        "window_bytes": d.window_bytes,
        "resident_bytes": d.resident_bytes,
        "streamed_bytes": d.streamed_bytes,
        "fits": d.fits,
    }


def _pins(plan: DeploymentPlan) -> dict:
    return {
        name: {
            "pinned_bytes": p.pinned_bytes,
            "pinned_layers": list(p.pinned_layers),
            "transfer_s_per_request": p.transfer_s_per_request,
            "baseline_transfer_s_per_request": p.baseline_transfer_s_per_request,
            "net_cost_bytes": p.net_cost_bytes,
            "moves_per_request": p.moves_per_request,
            "candidate_layers": p.candidate_layers,
            "page_cache_bytes": p.page_cache_bytes,
            "page_cache_fits": p.page_cache_fits,
            "disk_bytes_per_request": p.disk_bytes_per_request,
        }
        for name, p in plan.pins.plans.items()
    }


def report_dict(plan: DeploymentPlan) -> dict:
    """The JSON contract of the module docstring."""
    h = plan.host
    return {
        "deployment": plan.deployment,
        "mode": plan.mode,
        "merge": plan.merge,
        "host": {
            "limit_bytes": h.bytes,
            "source": h.source,
            "mem_total_bytes": h.mem_total,
            "cgroup_limit_bytes": h.cgroup_limit,
        },
        "budget": _budget(plan),
        "components": _components(plan),
        "device_plan": _device(plan),
        "pin_plans": _pins(plan),
        "transfer_s_per_request": plan.pins.transfer_s_per_request,
        "baseline_transfer_s_per_request": plan.pins.baseline_transfer_s_per_request,
        "offers": [
            {**o.offer._asdict(), "budget_bytes": o.budget_bytes, "pinned_bytes": o.pinned_bytes,
             "transfer_s_per_request": o.transfer_s_per_request}
            for o in plan.offers
        ],
        "warnings": list(plan.warnings),
        "notes": list(plan.pins.notes),
        "merge_reason": plan.merge_reason,
        "alternatives": [
            {"label": a.label, "merge": a.merge, "budget_bytes": a.budget_bytes,
             "committed_bytes": a.committed_bytes, "pinned_bytes": a.pinned_bytes,
             "pinned_layers": {name: list(layers) for name, layers in a.pinned_layers.items()},
             "transfer_s_per_request": a.transfer_s_per_request, "over_limit_bytes": a.over_limit_bytes}
            for a in plan.alternatives
        ],
        "lora_merge": None if plan.lora_merge is None else dict(plan.lora_merge),
        "host_share": None if plan.host_share is None else dict(plan.host_share),
    }


# ---------------------------------------------------------------- text


def compress_names(names) -> str:
    """``blocks.0 .. blocks.33, blocks.40`` for long runs of numbered layer names."""
    parts: list[list] = []  # [prefix, first, last]
    for name in names:
        found = re.fullmatch(r"(.*?)(\d+)", name)
        if found and parts and parts[-1][0] == found.group(1) and parts[-1][2] == int(found.group(2)) - 1:
            parts[-1][2] += 1
        elif found:
            parts.append([found.group(1), int(found.group(2)), int(found.group(2))])
        else:
            parts.append([name, None, None])
    out = []
    for prefix, first, last in parts:
        if first is None:
            out.append(prefix)
        elif first == last:
            out.append(f"{prefix}{first}")
        else:
            out.append(f"{prefix}{first}..{last}")
    return ", ".join(out) if out else "none"


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value * 1000:.1f} ms"


def _host_lines(plan: DeploymentPlan) -> list[str]:
    h, b = plan.host, plan.budget
    cgroup = format_size(h.cgroup_limit) if h.cgroup_limit else "none"
    return [
        f"host: limit {format_size(h.bytes)} ({h.source}); MemTotal {format_size(h.mem_total)}; "
        f"cgroup limit {cgroup}",
        *(_host_share_lines(plan.host_share) if plan.host_share else []),
        "budget:",
        *format_table([
            ("limit", format_size(b.limit), ""),
            ("- reserve", format_size(b.reserve), ""),
            ("- committed anonymous", format_size(b.committed_anonymous), ""),
            ("- committed shmem", format_size(b.committed_shmem), ""),
            ("- committed pinned", format_size(b.committed_pinned), ""),
            ("- process beyond reserve", format_size(b.process_excess), ""),
            *_build_reserve_rows(b),
            ("= room (pins + page cache)", format_size(b.room), ""),
            ("max pinned", format_size(b.max_pinned), ""),
            ("budget for pins", format_size(b.bytes), "(room, capped by max pinned)"),
        ], indent="  "),
        *_build_reserve_lines(b),
    ]


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
            "run time is being merged in the background, and its next layer's output and fp32 sum must find room"]


def _host_share_lines(share) -> list[str]:
    """This rank's part of the host budget: its pins are capped at that share."""
    alike = "; ranks taken to be alike: equal shares" if "no process group" in share["source"] else ""
    return [f"host share: local rank {share['local_rank']} of {share['local_world_size']} (from {share['source']}"
            f"{alike})",
            f"  {format_size(share['share_bytes'])} of the host budget {format_size(share['host_budget_bytes'])}, "
            f"split by need ({', '.join(format_size(s) for s in share['shares_bytes'])}); pins capped at this share"]


def _component_lines(plan: DeploymentPlan) -> list[str]:
    rows = [("component", "offload", "source", "layers", "anonymous", "file-backed", "pinned", "shmem", "total")]
    for name, s in plan.components.items():
        r = s.residency
        rows.append((name, s.offload, s.source, len(s.layers), format_size(r.anonymous),
                     format_size(r.file_backed + r.not_resident), format_size(r.pinned),
                     format_size(r.shmem), format_size(r.total)))
    return ["components (file-backed includes mapped bytes not yet read):", *format_table(rows, indent="  ")]


def _device_lines(plan: DeploymentPlan) -> list[str]:
    d = plan.device
    if d.component is None:
        return ["device plan: no component streams layer by layer"]
    total = len(d.resident_layers) + len(d.streamed_layers)
    return [
        f"device plan ({d.component}): VRAM {format_size(d.vram)} - reserve {format_size(d.reserve)} - rest "
        f"{format_size(d.rest_bytes)} - prefetch window {format_size(d.window_bytes)}",
        f"  resident {len(d.resident_layers)} of {total} ({format_size(d.resident_bytes)}): "
        f"{compress_names(d.resident_layers)}",
        f"  streamed {len(d.streamed_layers)} of {total} ({format_size(d.streamed_bytes)}): "
        f"{compress_names(d.streamed_layers)}",
    ]


def _pin_lines(plan: DeploymentPlan) -> list[str]:
    rows = [("component", "moves/req", "pinned layers", "pinned", "net cost", "page cache", "disk/req",
             "transfer/req", "all pageable")]
    for name, p in plan.pins.plans.items():
        rows.append((name, p.moves_per_request, f"{len(p.pinned_layers)} of {p.candidate_layers}",
                     format_size(p.pinned_bytes), format_size(p.net_cost_bytes),
                     format_size(p.page_cache_bytes) + ("" if p.page_cache_fits else " (no room)"),
                     format_size(p.disk_bytes_per_request), _seconds(p.transfer_s_per_request),
                     _seconds(p.baseline_transfer_s_per_request)))
    pins = plan.pins
    rows.append(("total", "", "", format_size(pins.pinned_bytes), format_size(pins.net_cost_bytes), "", "",
                 _seconds(pins.transfer_s_per_request), _seconds(pins.baseline_transfer_s_per_request)))
    lines = ["pin plans:", *format_table(rows, indent="  ")]
    for name, p in plan.pins.plans.items():
        if p.pinned_layers:
            lines.append(f"  {name} pinned: {compress_names(p.pinned_layers)}")
    if any(REST in p.pinned_layers for p in plan.pins.plans.values()):
        lines.append(f"  {REST}: the tensors outside every layer (embeddings, norms, heads), pinned as one unit")
    lines += [f"  note: {n}" for n in plan.pins.notes]
    return lines


def _offer_lines(plan: DeploymentPlan) -> list[str]:
    if not plan.offers:
        return []
    rows = [("offer", "component", "to mapped", "disk", "one-time", "budget", "pinned", "transfer/req")]
    rows.append(("(without offers)", "", "", "", "", format_size(plan.budget.bytes),
                 format_size(plan.pins.pinned_bytes), _seconds(plan.pins.transfer_s_per_request)))
    for o in plan.offers:
        rows.append((o.offer.provider, o.offer.component, format_size(o.offer.anonymous_bytes),
                     format_size(o.offer.disk_bytes), f"{o.offer.one_time_s:.1f} s", format_size(o.budget_bytes),
                     format_size(o.pinned_bytes), _seconds(o.transfer_s_per_request)))
    notes = [f"  {o.offer.provider}: {o.offer.note}" for o in plan.offers if o.offer.note]
    return ["offers:", *format_table(rows, indent="  "), *notes]


def _alternative_lines(plan: DeploymentPlan) -> list[str]:
    """This plan beside the same deployment planned another way (the in-place merge)."""
    if not plan.alternatives:
        return []
    rows = [("plan", "merge", "committed", "budget", "pinned", "pinned layers", "transfer/req")]
    layers = sum(len(p.pinned_layers) for p in plan.pins.plans.values())
    rows.append(("this plan", plan.merge, format_size(plan.budget.committed), format_size(plan.budget.bytes),
                 format_size(plan.pins.pinned_bytes), layers, _seconds(plan.pins.transfer_s_per_request)))
    for a in plan.alternatives:  # a plan killed while it loads never serves: no transfer time to compare
        rows.append((a.label, a.merge, format_size(a.committed_bytes), format_size(a.budget_bytes),
                     format_size(a.pinned_bytes), sum(len(v) for v in a.pinned_layers.values()),
                     "killed while loading" if a.over_limit_bytes else _seconds(a.transfer_s_per_request)))
    lines = ["compared (committed = non-reclaimable memory the components hold):", *format_table(rows, indent="  ")]
    for a in plan.alternatives:
        killed = (f"; its committed memory exceeds the host limit by {format_size(a.over_limit_bytes)}: without "
                  "swap it is killed while it loads" if a.over_limit_bytes else "")
        lines.append(f"  {a.label}: budget {format_size(a.budget_bytes)}, pins {format_size(a.pinned_bytes)} "
                     f"(this plan: budget {format_size(plan.budget.bytes)}, pins {format_size(plan.pins.pinned_bytes)})"
                     f"{killed}")
    return lines


def _lora_merge_lines(plan: DeploymentPlan) -> list[str]:
    """What lora_cache.merge did: layers hit, built, fallen back; bytes; seconds; rate."""
    m = plan.lora_merge
    if m is None:
        return []
    where = f"cache {str(m['cache_key'])[:12]} under {m.get('cache_root')}" if m.get("cache_key") else "in place"
    if m.get("cache_off"):
        where += f": {m['cache_off']}"
    rows = [("layers", "hit", "built", "fallen back", "in place", "merged", "written", "time", "rate"),
            (m["layers"], m["hit"], m["built"], m["fallen_back"], m["in_place"], format_size(m["bytes"]),
             format_size(m["bytes_written"]), f"{m['seconds']:.1f} s", format_rate(m["rate_bytes_per_s"]))]
    rounding = m.get("rounding") or {}
    lost = [f"{name} {share:.0%}" for name, share in sorted((rounding.get("lost") or {}).items())[:3]]
    said = [f"  rounding to the weights' dtype loses over {rounding['threshold']:.0%} of {len(rounding['lost'])} "
            f"layer(s)' update ({', '.join(lost)}): {len(rounding['at_runtime'])} at run time, "
            f"{len(rounding['merged_anyway'])} merged anyway"] if lost else []
    return [f"LoRA merge ({where}):", *format_table(rows, indent="  ", right_from=0), *said]


def report_text(plan: DeploymentPlan) -> str:
    """The report for people: aligned tables, sizes in GiB with one decimal."""
    title = [f"hostmem plan: {plan.deployment} ({plan.mode}, merge: {plan.merge})"]
    if plan.merge_reason:
        title.append(f"merge {plan.merge}: {plan.merge_reason}")
    sections = [
        title,
        _host_lines(plan),
        _component_lines(plan),
        _lora_merge_lines(plan),
        _device_lines(plan),
        _pin_lines(plan),
        _offer_lines(plan),
        _alternative_lines(plan),
        ["warnings:", *(f"  - {w}" for w in plan.warnings)] if plan.warnings else ["warnings: none"],
    ]
    return "\n\n".join("\n".join(s) for s in sections if s)
