"""What the plan says each hooked layer is: resident, pinned, kept in page cache, or released.

The device plan splits the streamed component into resident and streamed layers; the
pin plan pins some streamed layers. The rest stream from the page cache, and the pin
plan says whether the page cache can hold them next to the pins. When it cannot, the
kernel's LRU reads every one of them from disk on every pass (a cyclic scan larger than
the cache evicts each page just before its reuse), so the executor chooses a fixed set
that fits, **kept** (read once, never released), and streams only the rest, **released**
after use so that they never push a kept layer out. The kept set is spread evenly over
the pass, so that the disk has a streamed layer to read while every kept one computes.

The room is the plan's ``room_after_pins``, given to components in the planner's order
(most moves per request first), less the tensors outside every layer (used on every
pass, never released) and the read-ahead window. Read per pass once warm: the released
layers' reclaimable bytes.

The window is counted in bytes (:func:`window_bytes`): the layer computing, plus the
layers read ahead, up to ``prefetch`` of them but no more bytes than the larger of one
layer and a sixteenth of the stream. A layer read ahead beyond the next one only
absorbs jitter, while every byte of window is a byte not kept, read back on every pass:
counted in layers, 8 layers of 256 MiB with ``prefetch: 2`` would take 768 MiB and keep
nothing where 512 MiB of window keeps a layer more. The pin plan leaves this window's
room free (:func:`planners.pin_plan.plan_pins`), so pins never take the room the
released layers stream through. The plan's report states this module's kept set: one
function says which layers are kept, for the plan and the executor alike.
"""

from __future__ import annotations

from typing import NamedTuple

from .sizes import REST, Layer

__all__ = ["ComponentRoles", "disk_tier", "plan_roles", "read_ahead_bytes", "window_bytes"]

_STREAM_SHARE = 16  # read ahead at most a sixteenth of the stream (and always the next layer)

# ``plan`` below is a planners.deployment.DeploymentPlan, named and not imported: the
# planner asks these roles for its disk figure (planners.executor_tier), so this module
# sits below planners.deployment.


class ComponentRoles(NamedTuple):
    component: str
    moves: int  # passes per request
    order: tuple[str, ...]  # hooked layers in the order a pass runs them
    resident: tuple[str, ...]
    pinned: tuple[str, ...]
    kept: tuple[str, ...]
    released: tuple[str, ...]
    kept_bytes: int  # page cache the kept layers and the rest hold
    predicted_read_bytes: int  # per warm pass: what released layers read back
    read_ahead_bytes: int = 0  # how far past the layer computing the reads may reach

    def role(self, layer: str) -> str:
        for name in ("resident", "pinned", "kept", "released"):
            if layer in getattr(self, name):
                return name
        return "unplanned"


def _candidates(plan: "DeploymentPlan", name: str) -> tuple[tuple[Layer, ...], tuple[str, ...]]:
    """The units of ``name`` that move, and those the device plan keeps on the device."""
    sizes = plan.components[name]
    part = plan.device.part(name)  # each streamed component has its own (several may stream)
    if part is not None:
        streamed = set(part.streamed_layers)
        return tuple(u for u in sizes.units if u.name in streamed), tuple(part.resident_layers)
    return tuple(sizes.units), ()


def _spread_fit(layers: list[Layer], budget: int) -> set[str]:
    """Layers to keep under ``budget``, spread evenly over the pass (then any that still fit)."""
    need = sum(u.reclaimable for u in layers)
    if need <= budget:
        return {u.name for u in layers}
    share, acc, kept, left = (budget / need if need else 0.0), 0.0, set(), budget
    for unit in layers:
        acc += share
        if acc >= 1.0 and unit.reclaimable <= left:
            kept.add(unit.name)
            left -= unit.reclaimable
            acc -= 1.0
    for unit in layers:
        if unit.name not in kept and unit.reclaimable <= left and unit.reclaimable:
            kept.add(unit.name)
            left -= unit.reclaimable
    return kept


def read_ahead_bytes(sizes: list[int], prefetch: int) -> int:
    """How many bytes past the layer computing the read-ahead may hold, for layers of ``sizes``:
    ``prefetch`` of the largest, but no more than the larger of one layer and a sixteenth of
    the stream (none when ``prefetch`` is 0)."""
    largest = max(sizes, default=0)
    if not prefetch or not largest:
        return 0
    return max(largest, min(prefetch * largest, sum(sizes) // _STREAM_SHARE))


def window_bytes(sizes: list[int], prefetch: int) -> int:
    """The page cache the released layers stream through: the largest one computing, and the
    read-ahead past it (:func:`read_ahead_bytes`)."""
    return max(sizes, default=0) + read_ahead_bytes(sizes, prefetch)


def _component_roles(plan, name, room, prefetch, whole: bool = False) -> tuple[ComponentRoles, int]:
    """``whole``: every unpinned layer is kept (an expert that fits alone in its turn)."""
    pins = plan.pins.plans[name]
    units, resident = _candidates(plan, name)
    pinned = set(pins.pinned_layers)
    rest = [u for u in units if u.name == REST and u.name not in pinned]
    layers = [u for u in units if u.name != REST and u.name not in pinned]
    room -= sum(u.reclaimable for u in rest)
    sizes = [u.reclaimable for u in layers]
    if pins.page_cache_fits or whole:
        kept = {u.name for u in layers}
    else:
        kept = _spread_fit(layers, max(0, room - window_bytes(sizes, prefetch)))
    kept_bytes = sum(u.reclaimable for u in layers if u.name in kept) + sum(u.reclaimable for u in rest)
    released = tuple(u.name for u in layers if u.name not in kept)
    order = tuple(u.name for u in plan.components[name].layers)  # the rest is no layer: it is never hooked
    roles = ComponentRoles(
        component=name,
        moves=pins.moves_per_request,
        order=order,
        resident=tuple(r for r in resident if r != REST),
        pinned=tuple(p for p in pins.pinned_layers if p != REST),
        kept=tuple(u.name for u in layers if u.name in kept),
        released=released,
        kept_bytes=kept_bytes,
        predicted_read_bytes=sum(u.reclaimable for u in layers if u.name in released),
        read_ahead_bytes=read_ahead_bytes(sizes, prefetch),
    )
    if not pins.page_cache_fits:
        return roles, 0  # the window and the kept set took the room: later components read from disk
    return roles, max(0, room - kept_bytes + sum(u.reclaimable for u in rest))


def plan_roles(plan: "DeploymentPlan", prefetch: int) -> dict[str, ComponentRoles]:
    """Roles of every layer of every component the plan moves (see the module doc).

    Experts that take turns in a page cache too small for all of them but large enough
    for each (the pin plan's ``disk_once``) keep every layer: during its turn an expert
    is read once and served from the page cache, the kernel evicting the other's; the
    room is theirs by turns, and the components after them read from disk, as the pin
    plan says."""
    room = plan.pins.room_after_pins
    out, turns = {}, {}
    for name, pins in plan.pins.plans.items():  # the planner's order: most moves per request first
        if pins.disk_once:
            out[name], _ = _component_roles(plan, name, turns.setdefault(pins.alternates, room), prefetch, whole=True)
            room = 0
        else:
            out[name], room = _component_roles(plan, name, room, prefetch)
    return out  # offload "none" has no pin plan: it computes where it lies, nothing moves


def disk_tier(plan: "DeploymentPlan", prefetch: int, disk_read: float) -> dict[str, tuple[int, float]]:
    """``{component: (bytes read per request, seconds)}`` once warm, under the executor.

    The pin plan's own disk figure is what the kernel's LRU reads (every unpinned layer,
    every move, once the page cache is too small); this is what the executor reads: the
    released layers only, at ``disk_read`` bytes per second.
    """
    out = {}
    for name, roles in plan_roles(plan, prefetch).items():
        nbytes = roles.predicted_read_bytes * roles.moves
        out[name] = (nbytes, nbytes / disk_read)
    return out
