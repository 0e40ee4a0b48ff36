"""The device plan: which layers of the streamed component stay on the GPU.

Under the VRAM cap, less the device reserve, the plan keeps the component's rest
(tensors outside every layer, used on every pass) and a prefetch window of
``prefetch + 1`` layers in flight (the one computing and those being copied), then
keeps whole layers resident while they fit. Every other layer is streamed from
host memory on each pass, and only streamed layers are candidates for pinning.
Without a device budget (``vram: 0``) or room for the rest, the rest streams too.
"""

from __future__ import annotations

from typing import NamedTuple

from .sizes import ComponentSizes

__all__ = ["DevicePlan", "device_in_host_memory", "plan_device"]


class DevicePlan(NamedTuple):
    component: str | None
    vram: int
    reserve: int
    rest_bytes: int
    window_bytes: int
    resident_layers: tuple[str, ...]
    streamed_layers: tuple[str, ...]
    resident_bytes: int
    streamed_bytes: int
    fits: bool  # False: the rest and the window alone exceed the usable VRAM

    @property
    def usable(self) -> int:
        return max(0, self.vram - self.reserve)


def plan_device(sizes: ComponentSizes | None, vram: int, reserve: int, prefetch: int) -> DevicePlan:
    """Split the streamed component's layers into resident and streamed under ``vram``.

    ``vram == 0`` plans a host without a device budget: every layer streams.
    """
    if sizes is None:
        return DevicePlan(None, vram, reserve, 0, 0, (), (), 0, 0, True)
    layers = sizes.layers
    usable = max(0, vram - reserve)
    rest = sizes.rest.nbytes if sizes.rest is not None else 0
    total = rest + sum(layer.nbytes for layer in layers)
    if vram and total <= usable:
        return DevicePlan(sizes.name, vram, reserve, rest, 0, tuple(l.name for l in layers), (), total - rest, 0, True)
    window = (prefetch + 1) * max((layer.nbytes for layer in layers), default=0) if vram else 0
    left = usable - rest - window
    resident, streamed = [], []
    for layer in layers:
        if vram and layer.nbytes <= left:
            resident.append(layer)
            left -= layer.nbytes
        else:
            streamed.append(layer)
    fits = not vram or rest + window <= usable
    if rest and (not vram or not fits):
        streamed.append(sizes.rest)  # no room on the device: the rest moves with the layers
    return DevicePlan(
        component=sizes.name,
        vram=vram,
        reserve=reserve,
        rest_bytes=rest,
        window_bytes=window,
        resident_layers=tuple(l.name for l in resident),
        streamed_layers=tuple(l.name for l in streamed),
        resident_bytes=sum(l.nbytes for l in resident),
        streamed_bytes=sum(l.nbytes for l in streamed),
        fits=fits,
    )


def device_in_host_memory(device: DevicePlan) -> int:
    """What the device plan allocates on the device: its reserve, the layers kept there,
    the rest (where it fits) and the prefetch window. On a unified-memory host that is
    host memory (:mod:`planners.unified_memory`); nothing without a device budget."""
    if not device.vram:
        return 0
    kept = device.resident_bytes + device.window_bytes + (device.rest_bytes if device.fits else 0)
    return min(device.vram, device.reserve + kept)
