"""The host, device, transfer and workload sections: sizes, shares, rates and counts."""

from __future__ import annotations

import re
from typing import Any

from hostmem.errors import InputError
from hostmem.units import format_size, parse_fraction, parse_rate, parse_size

from .model import DeviceConfig, HostConfig, TransferConfig, WorkloadConfig
from .source import ConfigOrigin, Section, short

__all__ = ["parse_host", "parse_device", "parse_transfer", "parse_workload"]


def parse_host(origin: ConfigOrigin, data: Any) -> HostConfig:
    s = Section(origin, "host", data, ("limit", "reserve", "reserve_floor", "max_pinned"))
    limit_text = s.get("limit", "auto")
    limit = None if str(limit_text).strip().lower() == "auto" else s.parsed(
        "limit", parse_size, advice="write a size such as 32GiB, or auto"
    )
    if limit == 0:
        raise origin.error("host.limit", "0 leaves nothing to plan; write a size such as 32GiB, or auto")
    _not_bytes_by_mistake(s, "limit", limit)
    reserve, source, floor = _reserve(s)
    if limit is not None and reserve >= limit:
        what = "host.reserve_floor" if source == "measured" else "host.reserve"
        raise origin.error(
            what,
            f"{s.get(what.split('.')[1], format_size(reserve))!r}{_from(origin, what)} is not below host.limit "
            f"{limit_text!r}{_from(origin, 'host.limit')}; lower the reserve or raise the limit",
        )
    fraction, cap = _max_pinned(s)
    return HostConfig(limit=limit, reserve=reserve, max_pinned_fraction=fraction, max_pinned_bytes=cap,
                      reserve_source=source, reserve_floor=floor)


def _reserve(s: Section) -> tuple[int, str, int]:
    """``(reserve, source, floor)``: a size, or ``measured`` (planners.reserve resolves it
    from the deployment's last warmup; the default stands until one ran)."""
    from ..reserve import DEFAULT_FLOOR, DEFAULT_RESERVE, MEASURED

    floor = s.parsed("reserve_floor", parse_size, DEFAULT_FLOOR, "write a size such as 1GiB")
    if str(s.get("reserve", "")).strip().lower() == MEASURED:
        return floor, MEASURED, floor  # until resolved: the floor
    source = s.origin.overrides.get("host.reserve", "config" if s.has("reserve") else "default")
    reserve = s.parsed("reserve", parse_size, DEFAULT_RESERVE, "write a size such as 4GiB, or measured")
    return reserve, source, floor


def _not_bytes_by_mistake(s: Section, key: str, value: int | None) -> None:
    """Refuse a bare number under 1 MiB for a size that is gigabytes on any machine: ``vram: 24``
    is 24 bytes, which nobody means (a later check would blame the reserve instead)."""
    given = s.get(key, None)
    if value and value < 1 << 20 and _is_bare_number(given):
        raise s.origin.error(s.sub(key), f"{short(given)} is a number without a unit, which is {value} bytes; write "
                                         f"the unit, e.g. {given}GB or {given}GiB")


_BARE_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _is_bare_number(value: Any) -> bool:
    """A number without a unit: ``1``, ``0.75``, or the text ``"1"`` of an override."""
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) or (isinstance(value, str) and bool(_BARE_NUMBER.fullmatch(value.strip())))


def _as_float(value: Any) -> float:
    """``float(value)``, with a number too large for a float read as infinity (then refused)."""
    try:
        return float(value)
    except OverflowError:
        return float("inf")


def _max_pinned(s: Section) -> tuple[float | None, int | None]:
    """``max_pinned`` is a share of the limit (``75%``, ``0.75``) or a size with a unit (``18GiB``).

    A bare number is a share, so it must lie in [0, 1]: ``max_pinned: 1`` is all of the
    limit, never 1 byte, and ``max_pinned: 16`` (16 bytes? 16%? 16 GiB?) is refused.
    """
    value = s.get("max_pinned", "75%")
    if _is_bare_number(value):
        if not 0.0 <= _as_float(value) <= 1.0:
            raise s.origin.error(
                s.sub("max_pinned"),
                f"{short(value)} is a number without a unit, read as a share of the limit, so it must lie between "
                "0 and 1; write a share (75% or 0.75) or a size with its unit (18GiB)",
            )
        return _as_float(value), None
    if isinstance(value, str) and value.strip().endswith("%"):
        return s.parsed("max_pinned", parse_fraction, 0.75, "write e.g. 75% or 18GiB"), None
    return None, s.parsed("max_pinned", parse_size, None, "write e.g. 75% or 18GiB")


def _from(origin: ConfigOrigin, key: str) -> str:
    """`` (from HOSTMEM_...)`` where the environment set ``key``, not the file."""
    variable = origin.overrides.get(key)
    return f" (from {variable})" if variable else ""


def parse_device(origin: ConfigOrigin, data: Any) -> DeviceConfig:
    s = Section(origin, "device", data, ("vram", "reserve"))
    vram, reserve = s.size("vram", 0), s.size("reserve", 0)
    _not_bytes_by_mistake(s, "vram", vram)
    if vram and reserve >= vram:
        raise origin.error("device.reserve", f"{s.get('reserve')!r} is not below device.vram {s.get('vram')!r}"
                                             f"{_from(origin, 'device.vram')}; lower device.reserve or raise "
                                             "device.vram")
    return DeviceConfig(vram=vram, reserve=reserve)


_MIN_RATE = 1e6  # 1 MB/s: anything slower is a unit slip (24 instead of 24GB/s)


def _rate(text: Any) -> float:
    """A transfer rate of at least 1 MB/s (so that transfer times stay finite)."""
    rate = parse_rate(text)
    if rate < _MIN_RATE:
        raise InputError(f"{text!r} is slower than 1 MB/s; write a rate with its unit, e.g. 24GB/s")
    return rate


def parse_transfer(origin: ConfigOrigin, data: Any) -> TransferConfig:
    """Rates written in the config, or ``transfer: measured`` (the last ``hostmem calibrate --save``)."""
    if data == "measured":
        return TransferConfig(source="measured")
    if isinstance(data, str):
        raise origin.error("transfer", f"{data!r}: write measured (the rates of the last hostmem calibrate --save) "
                                       "or a mapping of pinned_h2d, pageable_h2d, disk_read")
    s = Section(origin, "transfer", data, ("pinned_h2d", "pageable_h2d", "disk_read"))
    d = TransferConfig()
    return TransferConfig(
        pinned_h2d=s.parsed("pinned_h2d", _rate, d.pinned_h2d),
        pageable_h2d=s.parsed("pageable_h2d", _rate, d.pageable_h2d),
        disk_read=s.parsed("disk_read", _rate, d.disk_read),
        source="config" if data else "default",
    )


def parse_workload(origin: ConfigOrigin, data: Any) -> WorkloadConfig:
    s = Section(origin, "workload", data, ("steps", "passes_per_step"))
    s.require("steps", "say how many denoising steps a request runs, e.g. steps: 4")
    return WorkloadConfig(
        steps=s.integer("steps", None, 1, maximum=10_000), passes_per_step=s.integer("passes_per_step", 1, 1, maximum=100)
    )
