"""What a layer's forward reads now, and whether a read-ahead was made from it.

Read-ahead is a hint: between the moment a layer's bytes are read ahead (or copied to
a device) and the moment it computes, a server may run other layers, skip this one, or
replace its weights (a LoRA merged or switched, an unmerge, a remap). So everything
the executor does ahead is tied to a :class:`Snapshot` of the layer: its layout (the
file ranges under its tensors) and its **fingerprint**, the tensors its modules hold
(object, address and version of each). At use the fingerprint is taken again; a
read-ahead made from another one is dropped and the layer is read now, and a layer
whose tensors changed gets a new layout. A snapshot holds its tensors' storages (a
detached alias each), so the mappings under its ranges stay mapped while any
read-ahead or release may still touch them.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

from .layout import LayerLayout, MapIndex, layer_layout

__all__ = ["Snapshot", "fingerprint", "held_tensors", "take_snapshot"]


def held_tensors(module: torch.nn.Module) -> Iterator[tuple[torch.nn.Module, str, str, torch.Tensor]]:
    """``(module, kind, name, tensor)`` of every parameter (kind ``p``) and buffer (``b``) under ``module``."""
    for owner in module.modules():
        for kind, table in (("p", owner._parameters), ("b", owner._buffers)):
            for name, tensor in table.items():
                if tensor is not None:
                    yield owner, kind, name, tensor


def fingerprint(module: torch.nn.Module) -> tuple:
    """Which tensors ``module``'s forward reads: each holder, object, address and version.

    An in-place write through ``tensor.data`` changes none of them; the pipeline never
    carries a device copy over a pass boundary for that reason (see :mod:`.pipeline`).
    A tensor made under ``torch.inference_mode()`` keeps no version (asking raises): -1.
    """
    return tuple((id(m), kind, name, id(t), t.data_ptr(), -1 if t.is_inference() else t._version)
                 for m, kind, name, t in held_tensors(module))


class Snapshot(NamedTuple):
    layout: LayerLayout
    fingerprint: tuple
    held: tuple  # detached aliases of the layout's tensors: their storages stay alive
    floors: tuple  # per range, where its file mapping begins: a release never reaches below

    @property
    def ranges(self):
        return self.layout.ranges


def take_snapshot(component: str, root: torch.nn.Module, name: str, maps: MapIndex | None = None) -> Snapshot:
    """The layer's layout and fingerprint now (``maps`` read from /proc/self/maps when not given)."""
    maps = maps if maps is not None else MapIndex()
    layout = layer_layout(component, root, name, maps)
    floors = tuple(maps.mapping_start(r.address) for r in layout.ranges)
    return Snapshot(layout, fingerprint(layout.module), tuple(t.detach() for t in layout.tensors), floors)
