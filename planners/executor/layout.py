"""Where a planned layer's bytes lie: its module, its tensors, and the file ranges under them.

The executor works on the layers a :class:`~planners.deployment.DeploymentPlan` names.
A layer's name is its layer pattern with the index filled in (``blocks.7``), which is
also the path of the submodule that computes it, so hooks go on
``component.get_submodule(name)``. Read-ahead and release act on the files under the
layer's tensors: each tensor that is a view of a file mapping is traced through
/proc/self/maps to ``(file, offset, length)``; anonymous tensors (a copied checkpoint)
have no file and are left where they are.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from hostmem.errors import InputError
from hostmem.procfs import PAGE_SIZE, read_maps
from hostmem.procfs.maps import strip_deleted

__all__ = ["FileRange", "LayerLayout", "MapIndex", "inner_pages", "outer_pages", "layer_layout", "layer_module",
           "module_tensors", "tensor_span"]


class FileRange(NamedTuple):
    """Bytes ``[offset, offset + length)`` of ``path``, mapped at ``address``."""

    path: str
    offset: int
    length: int
    address: int
    private: bool  # a private mapping (diffusers' loader's): a page a write copied is released with MADV_PAGEOUT only


class LayerLayout(NamedTuple):
    """One planned layer: its module, tensors, byte count and the file ranges under it."""

    component: str
    name: str
    module: torch.nn.Module
    tensors: tuple[torch.Tensor, ...]
    nbytes: int
    ranges: tuple[FileRange, ...]

    @property
    def mapped_bytes(self) -> int:
        return sum(r.length for r in self.ranges)


def layer_module(component: str, root: torch.nn.Module, name: str) -> torch.nn.Module:
    """The submodule that computes layer ``name``; a clear error when there is none."""
    try:
        return root.get_submodule(name)
    except AttributeError:
        raise InputError(
            f"{component}: the plan names layer {name!r}, but the module has no submodule of that name; the "
            "executor hooks each layer's forward, so the component's layer pattern must name its blocks "
            "(e.g. \"transformer_blocks.{i}.\") and the plan must be made from this module (plan_loaded)"
        ) from None


def tensor_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``(address, length)`` of the bytes a tensor's elements occupy (not its whole storage:
    a loader may hand out views of one storage that spans a whole file)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return tensor.data_ptr(), (last + 1) * tensor.element_size()


def module_tensors(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Parameters and buffers of ``module``, each span once (a tied weight once)."""
    seen, out = set(), []
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    for _, tensor in named:
        key = tensor_span(tensor)
        if key not in seen and key[1]:
            seen.add(key)
            out.append(tensor)
    return tuple(out)


class _Area(NamedTuple):
    start: int
    end: int
    offset: int
    path: str
    private: bool


def _joined(areas) -> list[_Area]:
    """Areas of one file mapped in a row become one: ``MADV_RANDOM`` on part of a mapping splits
    it, and a tensor across the split is still one file range."""
    out: list[_Area] = []
    for vma in areas:
        area = _Area(vma.start, vma.end, vma.offset, vma.path, vma.perms[3:4] == "p")  # written, or writable once
        last = out[-1] if out else None
        if last and last.end == area.start and last.path == area.path and last.private == area.private \
                and last.offset + (last.end - last.start) == area.offset:
            out[-1] = last._replace(end=area.end)
        else:
            out.append(area)
    return out


class MapIndex:
    """The file mappings of this process, read once from /proc/self/maps."""

    def __init__(self):
        self._areas = _joined(sorted(
            (vma for vma in read_maps() if vma.is_file and vma.path and vma.path.startswith("/")),
            key=lambda v: v.start,
        ))

    def _area(self, address: int) -> _Area | None:
        return next((area for area in self._areas if area.start <= address < area.end), None)

    def find(self, address: int, length: int) -> FileRange | None:
        """The file range under ``[address, address + length)``, or None for anonymous memory."""
        area = self._area(address)
        if area is None or address + length > area.end:
            return None  # anonymous, or across two areas: not one file range
        path = strip_deleted(area.path)
        if not os.path.isfile(path):
            return None
        return FileRange(path, area.offset + address - area.start, length, address, area.private)

    def mapping_start(self, address: int) -> int:
        """Where the file mapping holding ``address`` begins: no release may reach below it
        (the memory there may be anything, and ``MADV_DONTNEED`` zeroes anonymous pages)."""
        area = self._area(address)
        return area.start if area is not None else address


def _merge(ranges: list[FileRange]) -> tuple[FileRange, ...]:
    """Adjacent ranges of one file and one mapping become one (a layer's tensors lie in a row)."""
    out: list[FileRange] = []
    for r in sorted(ranges, key=lambda r: (r.path, r.offset)):
        last = out[-1] if out else None
        if last and last.path == r.path and last.offset + last.length >= r.offset \
                and last.address + (r.offset - last.offset) == r.address and last.private == r.private:
            end = max(last.offset + last.length, r.offset + r.length)
            out[-1] = last._replace(length=end - last.offset)
        else:
            out.append(r)
    return tuple(out)


def layer_layout(component: str, root: torch.nn.Module, name: str, maps: MapIndex) -> LayerLayout:
    """The layout of layer ``name`` of ``root``: module, tensors and the file ranges under them."""
    module = layer_module(component, root, name)
    tensors = module_tensors(module)
    ranges = []
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        found = maps.find(*tensor_span(tensor))
        if found is not None:
            ranges.append(found)
    nbytes = sum(tensor_span(t)[1] for t in tensors)
    return LayerLayout(component, name, module, tensors, nbytes, _merge(ranges))


def inner_pages(r: FileRange) -> tuple[int, int]:
    """``(address, length)`` of the whole pages inside ``r``: what may be released without
    touching a neighbour's page."""
    start = r.address + (-r.address) % PAGE_SIZE
    end = (r.address + r.length) - (r.address + r.length) % PAGE_SIZE
    return start, max(0, end - start)


def outer_pages(r: FileRange) -> tuple[int, int]:
    """``(address, length)`` of every page ``r`` touches, the partial ones at its ends too
    (none for an empty range)."""
    start = r.address - r.address % PAGE_SIZE
    if r.length <= 0:
        return start, 0
    end = r.address + r.length + (-(r.address + r.length)) % PAGE_SIZE
    return start, end - start
