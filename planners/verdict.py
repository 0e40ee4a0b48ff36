"""The verdict: does a plan fit the host and the device, and if not, why.

An operator (or CI) acts on one answer, so every plan carries one: the first line of
the text report, ``fits``/``over_limit_bytes``/``verdict`` in its JSON, and the exit
code of ``hostmem plan --check``. A plan does not fit when

- its committed non-reclaimable memory exceeds the host limit: without swap the
  kernel kills the process while it loads (``over_limit_bytes`` is by how much);
- committed memory and the reserve together exceed the limit: it loads, and is
  killed when the first request allocates what the reserve was meant to hold;
- the streamed component's rest and prefetch window exceed the usable VRAM: the
  device runs out of memory at the first request.

A plan that does not fit never serves a request, so it has no transfer time: the
report shows none (JSON ``null``), and nothing compares it as if it ran.
"""

from __future__ import annotations

from typing import NamedTuple

from hostmem.units import format_size

from .budget import HostBudget
from .device_plan import DevicePlan

__all__ = ["Verdict", "verdict"]


class Verdict(NamedTuple):
    fits: bool
    over_limit_bytes: int  # committed beyond the host limit (killed while loading); 0 otherwise
    reasons: tuple[str, ...]  # empty when it fits
    within: str = ""  # when it fits: the figures that say so

    @property
    def line(self) -> str:
        """``fits: yes: <figures>`` or ``fits: no: <reasons>`` (the report's first line)."""
        return f"fits: yes: {self.within}" if self.fits else f"fits: no: {'; '.join(self.reasons)}"


def verdict(budget: HostBudget, device: DevicePlan) -> Verdict:
    """The verdict of a plan with ``budget`` on the host and ``device`` on the GPU."""
    reasons = []
    over = max(0, budget.committed - budget.limit)
    if over:
        reasons.append(f"committed {format_size(budget.committed)} > limit {format_size(budget.limit)}: "
                       "killed while loading")
    elif budget.committed + budget.reserve > budget.limit:
        reasons.append(f"committed {format_size(budget.committed)} + reserve {format_size(budget.reserve)} > limit "
                       f"{format_size(budget.limit)}: killed at the first request")
    if not device.fits:
        reasons.append(f"device: rest {format_size(device.rest_bytes)} + prefetch window "
                       f"{format_size(device.window_bytes)} > usable VRAM {format_size(device.usable)}: "
                       "out of device memory at the first request")
    within = (f"committed {format_size(budget.committed)} + reserve {format_size(budget.reserve)} within limit "
              f"{format_size(budget.limit)}")
    return Verdict(not reasons, over, tuple(reasons), "" if reasons else within)
