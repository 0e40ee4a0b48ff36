"""Host-to-device copies of streamed layers on a side stream (a CUDA host only).

A small pool of device buffers (the plan's prefetch depth plus the one computing)
takes layer after layer. A pinned layer (page-locked in place) is copied straight from
its pages; a pageable one goes through two pinned staging buffers in turn, so that the
CPU fills one while the device copies the other. Events order everything: the compute
stream waits for a layer's copy before its forward, and a buffer is refilled only after
the forward that used it has finished. During the forward, the layer's parameters are
views into its buffer; afterwards they are the host tensors again, so no host copy of a
mapped weight is ever made.

With ``device`` the CPU the same code runs without streams and events (every copy is
synchronous): the twin the tests drive on a host without CUDA.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import NamedTuple

import torch

from .layout import LayerLayout, tensor_span

__all__ = ["DeviceCopier", "Loaded", "host_bytes", "slot_bytes"]

_ALIGN = 256
_STAGE = 16 << 20


def host_bytes(address: int, length: int) -> torch.Tensor:
    """A uint8 view of host memory at ``address`` (a mapping's pages), no copy."""
    return torch.frombuffer((ctypes.c_char * length).from_address(address), dtype=torch.uint8)


def slot_bytes(layout: LayerLayout) -> int:
    """The buffer a layer needs: each tensor's bytes, each start aligned as :meth:`DeviceCopier.load` places it."""
    spans = {tensor_span(t) for t in layout.tensors}
    return sum(n + (-n) % _ALIGN for _, n in spans)


class Loaded(NamedTuple):
    layout: LayerLayout
    slot: int
    ready: object  # torch.cuda.Event recorded on the side stream after the copy
    views: dict  # (module, kind, name) -> device tensor
    nbytes: int


class _Twin:
    """Stream and event stand-ins for the CPU twin: everything is already done."""

    def wait_event(self, event) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DeviceCopier:
    """Copies layers into ``slots`` device buffers of ``slot_bytes`` on a side stream."""

    def __init__(self, device: torch.device, slots: int, slot_bytes: int):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else _Twin()
        self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.free = [None] * slots  # an event recorded when the slot's forward finished
        self.staging = [torch.empty(_STAGE, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.staged = [None, None]  # an event recorded after the copy out of each staging buffer
        self._next = 0
        self._turn = 0

    def _copy_pageable(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        for at in range(0, src.numel(), _STAGE):
            n = min(_STAGE, src.numel() - at)
            k, self._turn = self._turn, 1 - self._turn
            if self.staged[k] is not None:
                self.staged[k].synchronize()  # the device has taken what this buffer held
            self.staging[k][:n].copy_(src[at:at + n])
            with self._on_side():
                dst[at:at + n].copy_(self.staging[k][:n], non_blocking=True)
                event = self._event()
                event.record(self.stream)
            self.staged[k] = event

    def _on_side(self):
        """The side stream as the current one (CUDA), or nothing to switch (the twin)."""
        return torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext()

    def _event(self):
        return torch.cuda.Event() if self.cuda else _Twin()

    def _current(self):
        return torch.cuda.current_stream(self.device) if self.cuda else _Twin()

    def load(self, layout: LayerLayout, pinned: bool) -> Loaded:
        """Start copying ``layout`` into the next free buffer; returns at once for pinned layers."""
        slot, self._next = self._next, (self._next + 1) % len(self.buffers)
        buffer, placed, at = self.buffers[slot], {}, 0
        if self.free[slot] is not None:
            self.stream.wait_event(self.free[slot])
        for tensor in layout.tensors:
            address, length = tensor_span(tensor)
            if (address, length) in placed:
                continue
            dst = buffer[at:at + length]
            src = host_bytes(address, length)
            if pinned:
                with self._on_side():
                    dst.copy_(src, non_blocking=True)
            else:
                self._copy_pageable(dst, src)
            placed[(address, length)] = at
            at += length + (-length) % _ALIGN
        ready = self._event()
        ready.record(self.stream)
        views = {}
        for module in layout.module.modules():
            for kind, table in (("p", module._parameters), ("b", module._buffers)):
                for name, tensor in table.items():
                    if tensor is None or tensor.device.type != "cpu":
                        continue
                    off = placed[tensor_span(tensor)]
                    size = tensor_span(tensor)[1]
                    view = buffer[off:off + size].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
                    views[(module, kind, name)] = view
        return Loaded(layout, slot, ready, views, at)

    def attach(self, loaded: Loaded) -> dict:
        """Make the layer compute from its device buffer; returns the host tensors to put back."""
        self._current().wait_event(loaded.ready)
        saved = {}
        for (module, kind, name), view in loaded.views.items():
            table = module._parameters if kind == "p" else module._buffers
            saved[(module, kind, name)] = table[name]
            table[name] = torch.nn.Parameter(view, requires_grad=False) if kind == "p" else view
        return saved

    def detach(self, loaded: Loaded, saved: dict) -> None:
        """Put the host tensors back and free the buffer once the forward is done with it."""
        for (module, kind, name), tensor in saved.items():
            (module._parameters if kind == "p" else module._buffers)[name] = tensor
        event = self._event()
        event.record(self._current())
        self.free[loaded.slot] = event

    def close(self) -> None:
        self.stream.synchronize()
        self.buffers.clear()
        self.staging.clear()
