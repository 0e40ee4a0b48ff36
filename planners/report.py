"""The startup report: text for people, JSON for machines.

The JSON form is a contract: sizes are bytes, times are seconds, and keys may be
added but never renamed::

    {"deployment": str, "mode": "what-if" | "live", "merge": "none" | "in-place" | "cached",
     "fits": bool, "over_limit_bytes": int, "verdict": str,
     "host": {"limit_bytes", "source", "mem_total_bytes", "cgroup_limit_bytes", "gpus",
              "headroom": null | {"bytes", "source", "figures": [{"name", "bytes", "source"}]},
              "unified_memory": null | {"unified": bool, "source": str}},
     "budget": {"bytes", "reserve_bytes", "reserve_source", "committed_bytes", "limit_bytes", "room_bytes",
                "max_pinned_bytes", "pin_cap_bytes", "build_reserve_bytes",
                "committed": {"anonymous_bytes", "shmem_bytes", "pinned_bytes", "process_excess_bytes",
                              "device_bytes"}},
     "components": {NAME: {"anonymous", "file_backed", "pinned", "total", "shmem", "swapped",
                           "not_resident", "non_reclaimable", "weights_bytes", "extra_anonymous",
                           "lora_target_bytes", "layers", "offload", "source"}},
     "device_plan": {"component", "resident_layers": [..], "streamed_layers": [..], "vram_bytes",
                     "reserve_bytes", "rest_bytes", "window_bytes", "resident_bytes",
                     "streamed_bytes", "fits", "kept_bytes", "peak_bytes", "peak_component",
                     "shortfall_bytes", "components": {NAME: {"offload", ...}}},
     "pin_plans": {NAME: {"pinned_bytes", "pinned_layers": [..], "transfer_s_per_request",
                          "baseline_transfer_s_per_request", "net_cost_bytes", "moves_per_request",
                          "candidate_layers", "page_cache_bytes", "page_cache_fits",
                          "disk_bytes_per_request", "kept_layers": [..], "disk_once", "alternates": [..]}},
     "transfer_s_per_request", "baseline_transfer_s_per_request",
     "transfer": null | {"pinned_h2d", "pageable_h2d", "disk_read", "source"},
     "offers": [{"provider", "component", "anonymous_bytes", "disk_bytes", "one_time_s", "note",
                 "budget_bytes", "pinned_bytes", "transfer_s_per_request", "fits", "applied_bytes"}],
     "warnings": [str], "notes": [str],
     "merge_reason": str,
     "alternatives": [{"label", "merge", "budget_bytes", "committed_bytes", "pinned_bytes",
                       "pinned_layers": {NAME: [..]}, "transfer_s_per_request", "over_limit_bytes"}],
     "lora_merge": null | {"layers", "hit", "built", "fallen_back", "in_place", "bytes",
                           "bytes_written", "seconds", "rate_bytes_per_s", "cache_key",
                           "cache_root", "adapters", "sealed_behind"},
     "host_share": null | {"local_rank", "local_world_size", "source", "host_budget_bytes",
                           "share_bytes", "shares_bytes", "needs_bytes"}}

``device_plan`` is every component's device memory (:mod:`planners.report_device`): its
top-level layer lists are the first streamed component's, ``components`` has each one's.
A ``host_share`` of a plan of several ranks (:mod:`planners.rank_plan`) adds the host's
and each rank's figures to the live form. ``disk_once``: the component's disk bytes are
read once per request, at its turn (experts that take turns), not on every move.
``fits`` is the plan's verdict (:mod:`planners.verdict`), ``verdict`` its line
(``fits: no: committed 35.4 GiB > limit 32.0 GiB: killed while loading``) and
``over_limit_bytes`` what is committed beyond the host limit. A plan that does not fit
serves no request: its transfer times (top level and per pin plan) are null, and so
is an offer's or an alternative's that does not fit either.
An offer's ``applied_bytes`` is what it takes off this plan's component, at most what
the component holds (its ``anonymous_bytes`` is what the provider says of itself);
the offers table shows the first, so it agrees with the budget.
``host.gpus`` is how many GPUs this machine shows (null: not looked for).
``host.unified_memory`` says whether the device's memory is host memory here, and the
fact that says so (:mod:`planners.unified_memory`; null: not looked for); where it is,
``budget.committed.device_bytes`` is the device plan's memory, committed on the host once.
``transfer`` is the rates planned with, in bytes per second, and their ``source``: ``default``,
``config``, or a line saying which ``hostmem calibrate --save`` record (``transfer: measured``).
``host.headroom`` is what ``limit: auto`` was made of (:mod:`planners.headroom`), each
figure with the file it was read from; null for a configured limit.
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

from hostmem.table import format_table
from hostmem.units import format_rate, format_size

from .deployment import DeploymentPlan
from .report_device import compress_names, device_dict, device_lines
from .report_host import host_lines
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
        "reserve_source": b.reserve_source,
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
            "device_bytes": b.committed_device,
        },
    }


def _served(seconds: float, fits: bool) -> float | None:
    """A transfer time, or None for a plan that does not fit (it never serves a request)."""
    return seconds if fits else None


def _pins(plan: DeploymentPlan) -> dict:
    return {
        name: {
            "pinned_bytes": p.pinned_bytes,
            "pinned_layers": list(p.pinned_layers),
            "transfer_s_per_request": _served(p.transfer_s_per_request, plan.fits),
            "baseline_transfer_s_per_request": _served(p.baseline_transfer_s_per_request, plan.fits),
            "net_cost_bytes": p.net_cost_bytes,
            "moves_per_request": p.moves_per_request,
            "candidate_layers": p.candidate_layers,
            "page_cache_bytes": p.page_cache_bytes,
            "page_cache_fits": p.page_cache_fits,
            "disk_bytes_per_request": p.disk_bytes_per_request,
            "kept_layers": list(p.kept_layers),  # the executor's kept set (planners.layer_roles)
            "disk_once": p.disk_once,
            "alternates": list(p.alternates),
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
        "fits": plan.fits,
        "over_limit_bytes": plan.verdict.over_limit_bytes,
        "verdict": plan.verdict.line,
        "host": {
            "limit_bytes": h.bytes,
            "source": h.source,
            "mem_total_bytes": h.mem_total,
            "cgroup_limit_bytes": h.cgroup_limit,
            "gpus": h.gpus,
            "headroom": None if h.headroom is None else {
                "bytes": h.headroom.bytes, "source": h.headroom.source,
                "figures": [f._asdict() for f in h.headroom.figures]},
            "unified_memory": None if h.unified is None else h.unified._asdict(),
        },
        "budget": _budget(plan),
        "components": _components(plan),
        "device_plan": device_dict(plan),
        "pin_plans": _pins(plan),
        "transfer_s_per_request": _served(plan.pins.transfer_s_per_request, plan.fits),
        "baseline_transfer_s_per_request": _served(plan.pins.baseline_transfer_s_per_request, plan.fits),
        "transfer": None if plan.transfer is None else plan.transfer._asdict(),
        "offers": [
            {**o.offer._asdict(), "budget_bytes": o.budget_bytes, "pinned_bytes": o.pinned_bytes,
             "transfer_s_per_request": _served(o.transfer_s_per_request, o.fits), "fits": o.fits,
             "applied_bytes": o.applied_bytes}
            for o in plan.offers
        ],
        "warnings": list(plan.warnings),
        "notes": list(plan.pins.notes),
        "merge_reason": plan.merge_reason,
        "alternatives": [
            {"label": a.label, "merge": a.merge, "budget_bytes": a.budget_bytes,
             "committed_bytes": a.committed_bytes, "pinned_bytes": a.pinned_bytes,
             "pinned_layers": {name: list(layers) for name, layers in a.pinned_layers.items()},
             "transfer_s_per_request": _served(a.transfer_s_per_request, a.fits),
             "over_limit_bytes": a.over_limit_bytes, "fits": a.fits}
            for a in plan.alternatives
        ],
        "lora_merge": None if plan.lora_merge is None else dict(plan.lora_merge),
        "host_share": None if plan.host_share is None else dict(plan.host_share),
    }


# ---------------------------------------------------------------- text


def _seconds(value: float, fits: bool = True) -> str:
    """A transfer time; ``-`` for a plan that does not fit, which serves no request."""
    if not fits:
        return "-"
    return f"{value:.2f} s" if value >= 1 else f"{value * 1000:.1f} ms"


def _component_lines(plan: DeploymentPlan) -> list[str]:
    rows = [("component", "offload", "source", "blocks", "anonymous", "file-backed", "pinned", "shmem", "total")]
    for name, s in plan.components.items():
        r = s.residency
        blocks = f"{len(s.layers)} + rest" if s.rest is not None and s.rest.nbytes else len(s.layers)
        rows.append((name, s.offload, s.source, blocks, format_size(r.anonymous),
                     format_size(r.file_backed + r.not_resident), format_size(r.pinned),
                     format_size(r.shmem), format_size(r.total)))
    return ["components (file-backed includes mapped bytes not yet read):", *format_table(rows, indent="  ")]


def _warning_lines(plan: DeploymentPlan) -> list[str]:
    """Warnings, and the disk reads per request that the notes describe, so 'none' never hides them."""
    disk = sum(p.disk_bytes_per_request for p in plan.pins.plans.values()) if plan.pins.notes else 0
    reads = f"each request reads {format_size(disk)} from disk (the notes under the pin plans)"
    if plan.warnings:
        return ["warnings:", *(f"  - {w}" for w in plan.warnings), *([f"  and {reads}"] if disk else [])]
    return [f"warnings: none, but {reads}"] if disk else ["warnings: none"]


def _pin_lines(plan: DeploymentPlan) -> list[str]:
    rows = [("component", "moves/req", "pinned blocks", "pinned", "net cost", "page cache", "disk/req",
             "transfer/req", "all pageable")]
    for name, p in plan.pins.plans.items():
        rest = REST in p.pinned_layers  # blocks counted as the components table counts them, the rest apart
        pinned = f"{len(p.pinned_layers) - rest} of {p.candidate_layers - p.rest_candidate}" + (" + rest" if rest else "")
        rows.append((name, p.moves_per_request, pinned,
                     format_size(p.pinned_bytes), format_size(p.net_cost_bytes),
                     format_size(p.page_cache_bytes) + ("" if p.page_cache_fits else " (no room)"),
                     format_size(p.disk_bytes_per_request), _seconds(p.transfer_s_per_request, plan.fits),
                     _seconds(p.baseline_transfer_s_per_request, plan.fits)))
    pins = plan.pins
    rows.append(("total", "", "", format_size(pins.pinned_bytes), format_size(pins.net_cost_bytes), "", "",
                 _seconds(pins.transfer_s_per_request, plan.fits),
                 _seconds(pins.baseline_transfer_s_per_request, plan.fits)))
    lines = ["pin plans:", *format_table(rows, indent="  ")]
    if not plan.fits:
        lines.append("  transfer: none, the plan does not fit (see its first line): it serves no request")
    for name, p in plan.pins.plans.items():
        if p.pinned_layers:
            lines.append(f"  {name} pinned: {compress_names(p.pinned_layers)}")
    if any(REST in p.pinned_layers for p in plan.pins.plans.values()):
        lines.append(f"  {REST}: the tensors outside every block (embeddings, norms, heads), pinned as one unit")
    lines += [f"  note: {n}" for n in plan.pins.notes]
    return lines


def _rate_lines(plan: DeploymentPlan) -> list[str]:
    """The rates the transfer times were priced at, and where they came from."""
    if plan.transfer is None:
        return []
    from .calibration import describe

    return [f"transfer rates: {describe(plan.transfer)}"]


def _offer_lines(plan: DeploymentPlan) -> list[str]:
    if not plan.offers:
        return []
    rows = [("offer", "component", "to mapped", "disk", "one-time", "budget", "pinned", "transfer/req")]
    rows.append(("(without offers)", "", "", "", "", format_size(plan.budget.bytes),
                 format_size(plan.pins.pinned_bytes), _seconds(plan.pins.transfer_s_per_request, plan.fits)))
    for o in plan.offers:
        rows.append((o.offer.provider, o.offer.component, format_size(o.applied_bytes),
                     format_size(o.offer.disk_bytes), f"{o.offer.one_time_s:.1f} s", format_size(o.budget_bytes),
                     format_size(o.pinned_bytes), _seconds(o.transfer_s_per_request, o.fits)))
    notes = [f"  {o.offer.provider}: {o.offer.note}" for o in plan.offers if o.offer.note]
    return ["offers:", *format_table(rows, indent="  "), *notes]


def _alternative_lines(plan: DeploymentPlan) -> list[str]:
    """This plan beside the same deployment planned another way (the in-place merge)."""
    if not plan.alternatives:
        return []
    rows = [("plan", "merge", "committed", "budget", "pinned", "pinned blocks", "transfer/req")]
    layers = sum(len(p.pinned_layers) for p in plan.pins.plans.values())
    rows.append(("this plan", plan.merge, format_size(plan.budget.committed), format_size(plan.budget.bytes),
                 format_size(plan.pins.pinned_bytes), layers, _seconds(plan.pins.transfer_s_per_request, plan.fits)))
    for a in plan.alternatives:  # a plan that does not fit never serves: no transfer time to compare
        rows.append((a.label, a.merge, format_size(a.committed_bytes), format_size(a.budget_bytes),
                     format_size(a.pinned_bytes), sum(len(v) for v in a.pinned_layers.values()),
                     "killed while loading" if a.over_limit_bytes else _seconds(a.transfer_s_per_request, a.fits)))
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
    merged = m["built"] + m["in_place"] + m["fallen_back"]  # a rate of hits alone measures mapping, not merging
    rows = [("tensors", "hit", "built", "fallen back", "in place", "merged", "written", "time", "rate"),
            (m["layers"], m["hit"], m["built"], m["fallen_back"], m["in_place"], format_size(m["bytes"]),
             format_size(m["bytes_written"]), f"{m['seconds']:.1f} s",
             format_rate(m["rate_bytes_per_s"]) if merged else "-")]
    hits = (["  every weight tensor came from the cache: nothing merged, nothing written"]
            if m["layers"] and m["hit"] == m["layers"] else [])
    if m.get("sealed_behind"):  # the layers are served; the disk is still taking them
        hits.append("  sealed behind the start: the layers written are made durable while the model serves; "
                    "the next start hits once that is done (this process waits for it at exit)")
    rounding = m.get("rounding") or {}
    lost = [f"{name} {share:.0%}" for name, share in sorted((rounding.get("lost") or {}).items())[:3]]
    said = [f"  rounding to the weights' dtype loses over {rounding['threshold']:.0%} of {len(rounding['lost'])} "
            f"weight tensor(s)' update ({', '.join(lost)}): {len(rounding['at_runtime'])} at run time, "
            f"{len(rounding['merged_anyway'])} merged anyway"] if lost else []
    return [f"LoRA merge ({where}):", *format_table(rows, indent="  ", right_from=0), *hits, *said]


def report_text(plan: DeploymentPlan) -> str:
    """The report for people: aligned tables, sizes in GiB with one decimal."""
    title = [plan.verdict.line, f"hostmem plan: {plan.deployment} ({plan.mode}, merge: {plan.merge})"]
    if plan.merge_reason:
        title.append(f"merge {plan.merge}: {plan.merge_reason}")
    sections = [
        title,
        host_lines(plan),
        _component_lines(plan),
        _lora_merge_lines(plan),
        device_lines(plan),
        _pin_lines(plan),
        _rate_lines(plan),
        _offer_lines(plan),
        _alternative_lines(plan),
        _warning_lines(plan),
    ]
    return "\n\n".join("\n".join(s) for s in sections if s)
