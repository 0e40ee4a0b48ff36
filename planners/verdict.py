"""The verdict: does a plan fit the host and the device, and if not, why.

An operator (or CI) acts on one answer, so every plan carries one: the first line of
the text report, ``fits``/``over_limit_bytes``/``verdict`` in its JSON, and the exit
code of ``hostmem plan --check``. A plan does not fit when

- its committed non-reclaimable memory exceeds the host limit: without swap the
  kernel kills the process while it loads (``over_limit_bytes`` is by how much);
- committed memory and the reserve together exceed the limit: it loads, and is
  killed when the first request allocates what the reserve was meant to hold;
- the device cannot hold what the plan puts there at its peak (the reserve, what is
  kept on it, and the largest part in flight: a streamed component's window or a whole
  ``offload: full`` component, :mod:`planners.device_plan`): it runs out of device
  memory at the first request. The reason names the component in flight at the peak
  and the shortfall, in decimal GB as vendors print device memory (GiB beside it).

A plan that does not fit never serves a request, so it has no transfer time: the
report shows none (JSON ``null``), and nothing compares it as if it ran.
"""

from __future__ import annotations

from typing import NamedTuple

from hostmem.units import format_size

from .budget import HostBudget
from .device_plan import DevicePlan

__all__ = ["Verdict", "device_digits", "format_device", "verdict"]


class Verdict(NamedTuple):
    fits: bool
    over_limit_bytes: int  # committed beyond the host limit (killed while loading); 0 otherwise
    reasons: tuple[str, ...]  # empty when it fits
    within: str = ""  # when it fits: the figures that say so

    @property
    def line(self) -> str:
        """``fits: yes: <figures>`` or ``fits: no: <reasons>`` (the report's first line)."""
        return f"fits: yes: {self.within}" if self.fits else f"fits: no: {'; '.join(self.reasons)}"


def _device_reason(device: DevicePlan) -> str | None:
    """Why the device cannot hold what the plan puts there, naming the component and the shortfall."""
    if device.fits:
        return None
    if device.shortfall:
        name, peak = device.peak
        n = device_digits(device.vram, peak)
        while_ = f" while {name} runs ({format_device(device.peak_bytes - device.kept_bytes)} in flight)" if name else ""
        return (f"device: {format_device(peak, n)} needed{while_} > VRAM {format_device(device.vram, n)} "
                f"(reserve {format_device(device.reserve)} + kept {format_device(device.kept_bytes - device.reserve)}"
                f"): short by {format_device(device.shortfall)}, out of device memory at the first request")
    part = next(p for p in device.parts if not p.rest_on_device)
    return (f"device: the rest of {part.component} ({format_device(part.rest_bytes)}) + its prefetch window "
            f"({format_device(part.window_bytes)}) do not fit the usable VRAM {format_device(device.usable)}: "
            "out of device memory at the first request")


_MOST_DIGITS = 9  # GB to the byte: two sides a byte apart never read alike


def format_device(nbytes: int, digits: int = 1) -> str:
    """Device memory as vendors print it (decimal GB, MB below one GB), the binary figure
    beside it; ``digits``: decimals of the GB and GiB figures (the MB one has one less)."""
    if nbytes < 1e6:
        return format_size(nbytes)
    decimal = f"{nbytes / 1e9:.{digits}f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.{digits - 1}f} MB"
    return f"{decimal} ({format_size(nbytes, digits)})"


def device_digits(vram: int, *sides: int) -> int:
    """Decimals enough that no side of a comparison with ``vram`` reads as it while it is
    not ("25.8 GB needed > VRAM 25.8 GB" for 10 MiB short): one, else as many as it takes."""
    return _enough_digits(format_device, vram, sides)


def _digits(limit: int, *sides: int) -> int:
    """Decimals enough that no side of the comparison reads as the limit while it is not
    ("reserve 4.0 GiB > limit 4.0 GiB" for 10 MiB over): one, else as many as it takes."""
    return _enough_digits(format_size, limit, sides)


def _enough_digits(shown, limit: int, sides) -> int:
    """The fewest decimals at which ``shown(side, digits)`` differs from ``shown(limit, digits)``
    for every side that is not the limit."""
    for digits in range(1, _MOST_DIGITS):
        mark = shown(limit, digits)
        if all(side == limit or shown(side, digits) != mark for side in sides):
            return digits
    return _MOST_DIGITS


def verdict(budget: HostBudget, device: DevicePlan, ranks: int = 1) -> Verdict:
    """The verdict of a plan with ``budget`` on the host and ``device`` on the GPU.

    With ``ranks`` above 1, ``budget`` is one rank's (a ``1/ranks`` part of the host) and
    the figures are said for the whole host: each rank's committed memory and reserve,
    times the ranks, against the host's limit.
    """
    reasons = []
    n = ranks
    committed, reserve, limit = budget.committed * n, budget.reserve * n, budget.limit * n
    digits = _digits(limit, committed, reserve, committed + reserve)

    def size(nbytes: int) -> str:
        return format_size(nbytes, digits)

    if n > 1:
        c, r = (f"committed {n} x {size(budget.committed)} = {size(committed)}",
                f"reserve {n} x {size(budget.reserve)} = {size(reserve)}")
        where = f"host limit {size(limit)} ({n} ranks)"
    else:
        c, r, where = f"committed {size(committed)}", f"reserve {size(reserve)}", f"limit {size(limit)}"
    over = max(0, budget.committed - budget.limit) * n
    if over:
        reasons.append(f"{c} > {where}: killed while loading")
    elif budget.committed + budget.reserve > budget.limit:
        reasons.append(f"{c} + {r} > {where}: killed at the first request")
    said = _device_reason(device)
    if said:
        reasons.append(said)
    within = f"{c} + {r} within {where}"
    if device.vram and not reasons:
        within += f"; device peak {format_device(device.peak_bytes)} within VRAM {format_device(device.vram)}"
    return Verdict(not reasons, over, tuple(reasons), "" if reasons else within)
