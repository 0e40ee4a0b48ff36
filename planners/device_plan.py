"""The device plan: what every component puts in device memory, and whether it fits.

A request runs its components one after another (the text encoder, then the DiT's
steps; Wan 2.2's two experts take turns at a boundary step), so the device holds two
kinds of memory:

- **kept** for the whole request: the device reserve, every ``offload: none``
  component whole, and of each streamed (``offload: layerwise``) component its rest
  (tensors outside every layer, used on every pass) and the layers kept resident;
- **in flight** while one component runs: a streamed component's prefetch window
  (``prefetch + 1`` of its largest layers: the one computing and those being copied),
  or a whole ``offload: full`` component (moved in, run, moved out).

The peak is the kept memory plus the largest in-flight part; the plan fits the device
when the peak is within ``vram``. The layers kept resident are chosen after the
windows and the largest full component are set aside, whole layers while they fit,
the layers of the component that moves most per request first. Every other layer
streams from host memory on each pass, and only streamed layers are candidates for
pinning. When every streamed layer fits next to the rest, no window is needed.
Without a device budget (``vram: 0``) every layer, and every rest, streams.

``vram`` is in bytes as the config wrote it: ``80GB`` is 80 x 10^9 bytes (74.5 GiB),
the decimal unit disk and GPU vendors print.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from .sizes import ComponentSizes

__all__ = ["DevicePlan", "StreamedPart", "Streamed", "device_in_host_memory", "plan_device", "plan_devices"]


class Streamed(NamedTuple):
    """A streamed component as the device plan needs it."""

    sizes: ComponentSizes
    prefetch: int
    moves: int = 1  # moves per request: components that move more keep their layers first


class StreamedPart(NamedTuple):
    """One streamed component's share of the device."""

    component: str
    rest_bytes: int
    window_bytes: int
    resident_layers: tuple[str, ...]
    streamed_layers: tuple[str, ...]
    resident_bytes: int
    streamed_bytes: int
    rest_on_device: bool


class DevicePlan(NamedTuple):
    vram: int
    reserve: int
    parts: tuple[StreamedPart, ...] = ()  # every streamed component, in config order
    held: tuple[tuple[str, int], ...] = ()  # offload none: (component, bytes) kept whole
    in_flight: tuple[tuple[str, int], ...] = ()  # offload full: (component, bytes) while it runs

    @property
    def usable(self) -> int:
        return max(0, self.vram - self.reserve)

    @property
    def kept_bytes(self) -> int:
        """Held for the whole request: the reserve, whole components, rests and resident layers."""
        parts = sum(p.resident_bytes + (p.rest_bytes if p.rest_on_device else 0) for p in self.parts)
        return self.reserve + sum(n for _, n in self.held) + parts

    def phases(self) -> tuple[tuple[str, int], ...]:
        """``(component, bytes in flight while it runs)``: each streamed window, each full component."""
        return tuple((p.component, p.window_bytes) for p in self.parts) + self.in_flight

    @property
    def peak(self) -> tuple[str | None, int]:
        """``(component in flight at the peak, peak bytes)``: the kept memory plus the largest phase."""
        name, largest = max(self.phases(), key=lambda phase: phase[1], default=(None, 0))
        return name, self.kept_bytes + largest

    @property
    def peak_bytes(self) -> int:
        return self.peak[1]

    @property
    def shortfall(self) -> int:
        """Bytes the device lacks at the peak (0 when it fits, and without a device budget)."""
        return max(0, self.peak_bytes - self.vram) if self.vram else 0

    @property
    def fits(self) -> bool:
        return not self.vram or (self.shortfall == 0 and all(p.rest_on_device for p in self.parts))

    def part(self, component: str) -> StreamedPart | None:
        return next((p for p in self.parts if p.component == component), None)

    # The first streamed component's figures, as one-component callers read them.
    @property
    def component(self) -> str | None:
        return self.parts[0].component if self.parts else None

    @property
    def rest_bytes(self) -> int:
        return self.parts[0].rest_bytes if self.parts else 0

    @property
    def window_bytes(self) -> int:
        return self.parts[0].window_bytes if self.parts else 0

    @property
    def resident_layers(self) -> tuple[str, ...]:
        return self.parts[0].resident_layers if self.parts else ()

    @property
    def streamed_layers(self) -> tuple[str, ...]:
        return self.parts[0].streamed_layers if self.parts else ()

    @property
    def resident_bytes(self) -> int:
        return sum(p.resident_bytes for p in self.parts)

    @property
    def streamed_bytes(self) -> int:
        return sum(p.streamed_bytes for p in self.parts)


def _window(stream: Streamed) -> int:
    """The layers on their way at once: the one computing and ``prefetch`` ahead, at the
    largest layer's size each; never more than every layer at once."""
    sizes = [layer.nbytes for layer in stream.sizes.layers]
    return min((stream.prefetch + 1) * max(sizes, default=0), sum(sizes))


def _rest(sizes: ComponentSizes) -> int:
    return sizes.rest.nbytes if sizes.rest is not None else 0


def _part(stream: Streamed, resident: set[str], window: int, rest_on_device: bool) -> StreamedPart:
    sizes = stream.sizes
    kept = [layer for layer in sizes.layers if layer.name in resident]
    moved = [layer for layer in sizes.layers if layer.name not in resident]
    if _rest(sizes) and not rest_on_device:
        moved.append(sizes.rest)  # no room on the device: the rest moves with the layers
    return StreamedPart(sizes.name, _rest(sizes), window, tuple(l.name for l in kept), tuple(l.name for l in moved),
                        sum(l.nbytes for l in kept), sum(l.nbytes for l in moved), rest_on_device)


def plan_devices(streamed: Sequence[Streamed], held: Mapping[str, int], in_flight: Mapping[str, int],
                 vram: int, reserve: int) -> DevicePlan:
    """The device plan of a deployment (see the module): ``streamed`` in config order,
    ``held`` the bytes of each ``offload: none`` component, ``in_flight`` of each full one."""
    held_t, flight_t = tuple(held.items()), tuple(in_flight.items())
    if not vram:  # no separate VRAM (unified memory): nothing kept, but each stream's window is still copied on
        parts = tuple(_part(s, set(), _window(s), False) for s in streamed)
        return DevicePlan(vram, reserve, parts, held_t, flight_t)
    usable = max(0, vram - reserve)
    fixed = sum(held.values())
    largest_full = max(in_flight.values(), default=0)
    everything = sum(s.sizes.weights_bytes for s in streamed)
    if fixed + everything + largest_full <= usable:
        parts = tuple(_part(s, {l.name for l in s.sizes.layers}, 0, True) for s in streamed)
        return DevicePlan(vram, reserve, parts, held_t, flight_t)
    windows = [_window(s) for s in streamed]
    left = usable - fixed - max([largest_full, *windows])
    rest_on = []
    for s in streamed:
        on = _rest(s.sizes) <= left
        left -= _rest(s.sizes) if on else 0
        rest_on.append(on)
    resident: list[set[str]] = [set() for _ in streamed]
    for i in sorted(range(len(streamed)), key=lambda i: -streamed[i].moves):  # stable: config order among equals
        for layer in streamed[i].sizes.layers:
            if layer.nbytes <= left:
                resident[i].add(layer.name)
                left -= layer.nbytes
    # a component whose every layer stayed on the device streams nothing: it needs no window
    windows = [0 if len(resident[i]) == len(s.sizes.layers) and rest_on[i] else w
               for i, (s, w) in enumerate(zip(streamed, windows))]
    parts = tuple(_part(s, resident[i], windows[i], rest_on[i]) for i, s in enumerate(streamed))
    return DevicePlan(vram, reserve, parts, held_t, flight_t)


def plan_device(sizes: ComponentSizes | None, vram: int, reserve: int, prefetch: int) -> DevicePlan:
    """The device plan of one streamed component alone (``None``: nothing streams)."""
    return plan_devices([Streamed(sizes, prefetch)] if sizes is not None else [], {}, {}, vram, reserve)


def device_in_host_memory(device: DevicePlan) -> int:
    """What the device plan allocates on the device at its peak: the reserve, what is kept
    there and the largest part in flight. On a unified-memory host that is host memory
    (:mod:`planners.unified_memory`), capped by a device budget where one is given; with
    none (``device.vram: 0``, "no separate VRAM") all of it: the device reserve, each
    full component copied on while it runs and the streamed window are host memory too."""
    if not device.vram:
        return device.peak_bytes
    return min(device.vram, device.peak_bytes)
