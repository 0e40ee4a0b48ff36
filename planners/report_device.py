"""The device section of the report: every component's device memory, text and JSON.

Device memory is printed as vendors print it, in decimal GB (``80GB`` is 80 x 10^9
bytes), with the binary figure beside it; JSON has bytes. The section lists what is
kept on the device for the whole request (the reserve, ``offload: none`` components,
each streamed component's rest and resident blocks), what is in flight while each
component runs (a streamed component's prefetch window, a whole ``full`` component),
and the peak: the kept memory plus the largest part in flight.
"""

from __future__ import annotations

import re

from hostmem.table import format_table

from .sizes import REST
from .verdict import device_digits, format_device

__all__ = ["compress_names", "device_dict", "device_lines"]


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


def device_dict(plan) -> dict:
    """``device_plan`` of the JSON: the first streamed component's figures at the top (as
    before several could stream), every component's under ``components``, and the peak."""
    d = plan.device
    name, peak = d.peak
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
        "kept_bytes": d.kept_bytes,
        "peak_bytes": peak,
        "peak_component": name,
        "shortfall_bytes": d.shortfall,
        "components": {
            **{p.component: {"offload": "layerwise", "rest_bytes": p.rest_bytes, "rest_on_device": p.rest_on_device,
                             "window_bytes": p.window_bytes, "resident_layers": list(p.resident_layers),
                             "streamed_layers": list(p.streamed_layers), "resident_bytes": p.resident_bytes,
                             "streamed_bytes": p.streamed_bytes} for p in d.parts},
            **{n: {"offload": "none", "held_bytes": b} for n, b in d.held},
            **{n: {"offload": "full", "in_flight_bytes": b} for n, b in d.in_flight},
        },
    }


def device_lines(plan) -> list[str]:
    d = plan.device
    if not d.parts and not d.held and not d.in_flight:
        return ["device plan: nothing runs on the device"]
    if not d.vram:
        head = "device plan: no device budget (device.vram 0): every block streams, nothing is kept on the device"
        return [head, *_part_lines(d)]
    no_gpu = ["  (this machine has no GPU: this is the device plan of the host the config describes)"
              ] if plan.host.gpus == 0 else []
    name, peak = d.peak
    rows = [("device memory", "kept", "in flight")]
    rows.append(("reserve", format_device(d.reserve), ""))
    rows += [(n, format_device(b), "") for n, b in d.held]
    for p in d.parts:
        kept = p.resident_bytes + (p.rest_bytes if p.rest_on_device else 0)
        rows.append((p.component, format_device(kept), f"{format_device(p.window_bytes)} (window)"))
    rows += [(n, "", f"{format_device(b)} (whole)") for n, b in d.in_flight]
    state = "fits" if d.fits else f"short by {format_device(d.shortfall)}" if d.shortfall else "does not fit"
    n = device_digits(d.vram, peak)
    return [
        f"device plan: VRAM {format_device(d.vram, n)} (device.vram, decimal GB as vendors print it)",
        *no_gpu,
        *format_table(rows, indent="  "),
        f"  peak {format_device(peak, n)} = reserve and kept {format_device(d.kept_bytes)} + "
        f"{name or 'nothing'} in flight: {state}",
        *_part_lines(d),
    ]


def _part_lines(d) -> list[str]:
    out = []
    for p in d.parts:
        every = [*p.resident_layers, *p.streamed_layers]
        total = sum(1 for n in every if n != REST)  # the blocks, as the components table counts them
        out += [f"  {p.component}: resident {_blocks(p.resident_layers, total)} ({format_device(p.resident_bytes)}): "
                f"{compress_names(p.resident_layers)}",
                f"  {p.component}: streamed {_blocks(p.streamed_layers, total)} "
                f"({format_device(p.streamed_bytes)}): {compress_names(p.streamed_layers)}"]
    return out


def _blocks(names, total: int) -> str:
    """``"2 of 3 blocks"``, with ``", and the rest"`` where the tensors outside every block are among ``names``."""
    return f"{sum(1 for n in names if n != REST)} of {total} blocks" + (", and the rest" if REST in names else "")
