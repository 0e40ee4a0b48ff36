"""Host-to-device copies of streamed layers on a side stream (a CUDA host only).

A small pool of device buffers (the plan's prefetch depth plus the one computing)
takes layer after layer. A slot belongs to one load from :meth:`DeviceCopier.acquire`
until :meth:`DeviceCopier.give_back` (the pipeline gives it back after the forward
that used it, or when it drops a load it no longer wants), so a load read ahead is
never overwritten by another layer's while it waits. A pinned layer (page-locked in
place) is copied straight from its pages; a pageable one goes through two pinned
staging buffers in turn, so that the CPU fills one while the device copies the
other. Events order everything: the compute stream waits for a layer's copy before
its forward, and a buffer is refilled only after the forward that used it has finished.
During the forward, the layer's parameters are views into its buffer; afterwards they
are the host tensors again, so no host copy of a mapped weight is ever made.

A load copies the tensors the layer's modules hold when it runs (not a list made at
start) and records which (:func:`planners.executor.snapshot.fingerprint`): the
pipeline uses it only while the module still holds those same tensors.

Each tensor is placed in its buffer at the alignment it has on the host, modulo a
page on the CPU twin (a CPU kernel's choice, and so its rounding, may depend on it: a
1-row fp32 ``linear`` gives other bits for a weight 4 bytes off a 16-byte boundary) and
at 256 bytes on a device (what its allocator gives a tensor). With ``device`` the CPU
the same code runs without streams and events (every copy is synchronous): the twin
the tests drive on a host without CUDA.

Buffers, staging and views are made outside ``torch.inference_mode()`` whatever mode the
caller runs under (a server that enters the executor inside it): inference tensors refuse
the worker thread's copies (inference mode is per thread) and keep no version, by which
:meth:`DeviceCopier.detach` sees what a forward wrote.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import NamedTuple

import torch

from .layout import tensor_span
from .snapshot import fingerprint, held_tensors

__all__ = ["DeviceCopier", "Loaded", "alignment", "host_bytes", "same_bits", "slot_bytes", "standing_in"]

_ALIGN = 256  # a device buffer's tensors start at this alignment
_PAGE = 4096  # the CPU twin keeps each tensor's address modulo a page
_STAGE = 16 << 20


def host_bytes(address: int, length: int) -> torch.Tensor:
    """A uint8 view of host memory at ``address`` (a mapping's pages), no copy."""
    return torch.frombuffer((ctypes.c_char * length).from_address(address), dtype=torch.uint8)


def _spans(module: torch.nn.Module) -> list[tuple[int, int]]:
    out = []
    for _, _, _, tensor in held_tensors(module):
        if tensor.device.type == "cpu":
            span = tensor_span(tensor)
            if span[1] and span not in out:
                out.append(span)
    return out


def slot_bytes(layout, align: int = _PAGE) -> int:
    """The buffer a layer needs: each tensor's bytes, each start placed as :meth:`DeviceCopier.load`
    places it (at most ``align`` bytes of padding each)."""
    return sum(n + align for _, n in _spans(layout.module))


class Loaded(NamedTuple):
    layout: object  # the LayerLayout the load was made for
    slot: int | None  # the slot the load owns (given back after use, even when the layer outgrew it)
    ready: object  # torch.cuda.Event recorded on the side stream after the copy
    views: dict  # (module, kind, name) -> device tensor
    nbytes: int
    fingerprint: tuple  # the tensors it copied (snapshot.fingerprint of the module then)
    buffer: torch.Tensor | None = None  # a one-off buffer (the layer outgrew the slots), kept alive until used


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
        self.align = alignment(device)
        self.stream = torch.cuda.Stream(device=device) if self.cuda else _Twin()
        with torch.inference_mode(False):  # never inference tensors (see the module doc)
            self.buffers = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(slots)]
            self.staging = [torch.empty(_STAGE, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]
        self.free = [None] * slots  # an event recorded when the slot's forward finished
        self.idle = list(range(slots))  # slots no load owns
        self.staged = [None, None]  # an event recorded after the copy out of each staging buffer
        self._turn = 0
        self._lock = threading.Lock()  # loads run on the worker and, for a late layer, in the caller

    # ------------------------------------------------------------------ slots
    def acquire(self) -> int | None:
        """A slot for one load, or None when every slot is owned."""
        return self.idle.pop(0) if self.idle else None

    def give_back(self, slot: int | None) -> None:
        """The slot's load is used or dropped: a later load may take it."""
        if slot is not None and slot not in self.idle:
            self.idle.append(slot)

    # ------------------------------------------------------------------ copies
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

    def _place(self, buffer: torch.Tensor, spans) -> dict[tuple[int, int], int]:
        """Where each span starts in ``buffer``: aligned as :data:`align` says (see the module doc)."""
        base, at, placed = buffer.data_ptr(), 0, {}
        for address, length in spans:
            residue = address % self.align if not self.cuda else 0
            at += (residue - (base + at)) % self.align
            placed[(address, length)] = at
            at += length
        return placed

    def load(self, layout, pinned: bool, slot: int | None) -> Loaded:
        """Copy the tensors ``layout``'s module holds now into ``slot`` (a one-off buffer when
        None or too small); returns at once for pinned layers on a device."""
        with self._lock, torch.inference_mode(False):  # a late layer loads in the caller, maybe in that mode
            module = layout.module
            taken = fingerprint(module)
            tensors = [(m, kind, name, t) for m, kind, name, t in held_tensors(module) if t.device.type == "cpu"]
            spans = _spans(module)
            need = sum(n + self.align for _, n in spans)
            own = None
            if slot is None or need > self.buffers[slot].numel():
                own = torch.empty(need, dtype=torch.uint8, device=self.device)
                if self.cuda:
                    own.record_stream(self.stream)  # the copy runs there: no reuse before it ends
            buffer = own if own is not None else self.buffers[slot]
            if own is None and self.free[slot] is not None:
                self.stream.wait_event(self.free[slot])
            placed = self._place(buffer, spans)
            for (address, length), at in placed.items():
                dst, src = buffer[at:at + length], host_bytes(address, length)
                if pinned:
                    with self._on_side():
                        dst.copy_(src, non_blocking=True)
                else:
                    self._copy_pageable(dst, src)
            ready = self._event()
            ready.record(self.stream)
            views = {}
            for m, kind, name, tensor in tensors:
                span = tensor_span(tensor)
                if not span[1]:
                    continue
                at = placed[span]
                view = buffer[at:at + span[1]].view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
                views[(m, kind, name)] = view
            return Loaded(layout, slot, ready, views, sum(n for _, n in spans), taken, own)

    def attach(self, loaded: Loaded) -> dict:
        """Make the layer compute from its device buffer; returns the host tensors to put back."""
        self._current().wait_event(loaded.ready)
        saved = {}
        for (module, kind, name), view in loaded.views.items():
            table = module._parameters if kind == "p" else module._buffers
            saved[(module, kind, name)] = table[name]
            table[name] = standing_in(table[name], view, kind)
        saved[_VERSION] = _version_of(loaded)
        return saved

    def detach(self, loaded: Loaded, saved: dict) -> None:
        """Put the host tensors back (where the forward left the views) and free the buffer once
        the forward is done with it."""
        saved = dict(saved)
        written = saved.pop(_VERSION) != _version_of(loaded)  # the views share their buffer's version
        for (module, kind, name), tensor in saved.items():
            table = module._parameters if kind == "p" else module._buffers
            held = table.get(name)
            if held is not None and held is not tensor and _is_view_of(held, loaded.views[(module, kind, name)]):
                if written and not same_bits(held, tensor):
                    _written_back(loaded.layout, f"{type(module).__name__}.{name}", tensor, held)
                table[name] = tensor
        if loaded.buffer is not None and self.cuda:
            loaded.buffer.record_stream(self._current())  # freed with the Loaded: not before the forward ends
        if loaded.buffer is None and loaded.slot is not None:
            event = self._event()
            event.record(self._current())
            self.free[loaded.slot] = event

    def close(self) -> None:
        self.stream.synchronize()
        self.buffers.clear()
        self.staging.clear()


_VERSION = "version"  # the entry of attach's saved tensors that holds the buffer's version


def _version_of(loaded: Loaded) -> int | None:
    """The version the views of the load's buffer share (bumped by any write into one of
    them); None where there is none to ask (no views, or inference tensors)."""
    view = next(iter(loaded.views.values()), None)
    return None if view is None or view.is_inference() else view._version


def same_bits(a: torch.Tensor, b: torch.Tensor, chunk: int = 64 << 20) -> bool:
    """Whether ``a`` (a device view) holds the bytes of ``b`` (its host tensor): NaNs alike,
    compared ``chunk`` bytes at a time on the host, so that a large weight is never copied
    to host memory whole."""
    x, y = (t.detach().reshape(-1).view(torch.uint8) for t in (a, b))
    if x.numel() != y.numel():
        return False
    return all(torch.equal(x[i:i + chunk].to("cpu"), y[i:i + chunk].to("cpu")) for i in range(0, x.numel(), chunk))


def _written_back(layout, what: str, host: torch.Tensor, written: torch.Tensor) -> None:
    """A forward wrote into its own parameter or buffer (a step counter, running statistics):
    the write goes back to the host tensor, as it would have gone there without the
    executor. Into a read-only mapping of the checkpoint it cannot (the model alone would
    fault on it): that is an error that says so, never a write dropped."""
    start, length = tensor_span(host)
    for r in layout.ranges:
        if not r.private and r.address < start + length and start < r.address + r.length:
            raise RuntimeError(f"{layout.name}: its forward wrote into {what}, a read-only mapping of "
                               f"{r.path}; copy that tensor into memory of its own (or load the checkpoint "
                               "writable) to run such a layer")
    with torch.no_grad():
        host.copy_(written.to(host.device))


def standing_in(held: torch.Tensor, view: torch.Tensor, kind: str, requires_grad: bool = False) -> torch.Tensor:
    """The device view as the tensor it stands in for: a parameter, or a buffer, of the same
    class with the same attributes (a quantized weight's class reads its quantization from
    them: diffusers' GGUFParameter keeps ``quant_type``, and without it computes on the raw
    bytes as if they were weights). ``requires_grad``: a parameter's, where it goes back to
    the host for good (the device path itself runs without gradients)."""
    if type(held) in (torch.nn.Parameter, torch.Tensor):
        return torch.nn.Parameter(view, requires_grad=requires_grad) if kind == "p" else view
    standing = view.as_subclass(type(held))
    standing.__dict__.update(held.__dict__)
    if requires_grad and standing.is_floating_point():
        standing.requires_grad_(True)
    return standing


def _is_view_of(held: torch.Tensor | None, view: torch.Tensor) -> bool:
    """Whether the table still holds the view put there (not a tensor the forward replaced it with)."""
    return held is not None and held.data_ptr() == view.data_ptr() and held.device == view.device


def alignment(device: torch.device) -> int:
    """How a copy of ``device`` places its tensors (see the module doc): 256 bytes on a device, a page on the twin."""
    return _ALIGN if device.type == "cuda" else _PAGE
