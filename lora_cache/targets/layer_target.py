"""One parameter to merge, and where its bytes live: the canonical form laid on a model.

:class:`LayerTarget` is what the read stage hands every later one: a parameter of the
model (by its qualified name, :func:`named_parameters`) with the adapters' terms that
change it, in order (:class:`lora_cache.terms.delta.Delta`), and for a tensor-parallel
rank the part of the whole weight it holds (:class:`WeightPart`). :class:`AddressSpace`
answers where a tensor's bytes lie (a read-only mapping, a private copy), which the key
(the base's shards) and the placement (in place or mapped) both ask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import torch
from torch import nn

from hostmem.procfs import PAGE_SIZE, Vma
from hostmem.slots import MappedAreas

from ..terms.delta import Delta

__all__ = ["AddressSpace", "LayerTarget", "WeightPart", "components_of", "named_parameters"]


class WeightPart(Protocol):
    """The part of a whole weight a parameter holds (a tensor-parallel rank's
    :class:`lora_cache.ranks.tp_shards.Shard`): it sums its own part of the whole layer's merge,
    so this room never needs the shards' room (which builds on it)."""

    def merged(self, base: torch.Tensor, deltas: list[Delta], out: torch.Tensor, scratch, workers=None,
               claim=None, publish=None, kernel: str = ...) -> torch.Tensor:
        """``scratch``: a :class:`lora_cache.compute.buffers.Scratch`; ``kernel``: the layer's
        (default :data:`lora_cache.compute.merge_math.FP32_ROWS`)."""


@dataclass(eq=False)
class LayerTarget:
    """One parameter to merge: where it lives and the deltas that change it, in order."""

    name: str
    module: nn.Module
    attr: str
    deltas: list[Delta] = field(default_factory=list)
    shard: WeightPart | None = None  # the part of the whole weight the parameter holds (lora_cache.ranks.tp_shards)
    kernel: str | None = None  # fixed by the caller: a shard is summed by its whole layer's kernel

    @property
    def current(self) -> nn.Parameter:
        return self.module._parameters[self.attr]

    @property
    def nbytes(self) -> int:
        return self.current.numel() * self.current.element_size()


def components_of(model) -> dict[str, nn.Module]:
    """``{"": model}`` for one module, the dict itself for named components."""
    if isinstance(model, nn.Module):
        return {"": model}
    if isinstance(model, Mapping) and all(isinstance(m, nn.Module) for m in model.values()):
        return dict(model)
    raise TypeError(f"expected an nn.Module or a dict of named nn.Modules, not {type(model).__name__}")


def named_parameters(model) -> dict[str, tuple[nn.Module, str]]:
    """Every parameter by qualified name (``component.`` prefixed for a dict), to its owner."""
    out: dict[str, tuple[nn.Module, str]] = {}
    for component, root in components_of(model).items():
        for module_name, module in root.named_modules():
            for attr, param in module._parameters.items():
                if param is not None:
                    name = ".".join(p for p in (component, module_name, attr) if p)
                    out.setdefault(name, (module, attr))
    return out


class AddressSpace:
    """This process's memory areas (:class:`hostmem.slots.MappedAreas`), read on first use.

    Lazy because a merge served wholly from the cache never needs to ask where a
    tensor's bytes live.
    """

    def __init__(self):
        self._mapped: MappedAreas | None = None
        self._pagemap = None  # a hostmem.pagemap.PagemapReader, on first use

    def area_of(self, tensor: torch.Tensor) -> Vma | None:
        if self._mapped is None:
            self._mapped = MappedAreas()
        return self._mapped.area_of(tensor)

    def is_writable(self, tensor: torch.Tensor) -> bool:
        """False for a read-only mapping (writing would fault), True otherwise."""
        if tensor.device.type != "cpu":
            return True
        area = self.area_of(tensor)
        return area is None or "w" in area.perms

    def sums_where_it_lies(self, tensor: torch.Tensor) -> bool:
        """Whether an in-place merge sums into ``tensor``'s own bytes (see :func:`merge_in_place`).

        Yes where they are writable and already the process's own: a heap tensor, a GPU
        tensor, a private mapping mostly copied already. No on a read-only mapping, and
        no on a private file mapping most of whose pages are still the file's
        (safetensors' own loader maps files so; the pages are read from
        ``/proc/self/pagemap``, and a page at each end may be a neighbour's copy):
        summing there copies the file's pages on write, one fault per 4 KiB page, at
        4.2 s per GiB against 0.3 s for the sum itself, measured on a 2-core VM.
        """
        if not self.is_writable(tensor):
            return False
        area = self.area_of(tensor) if tensor.device.type == "cpu" else None
        if area is None or area.is_shared or not area.inode:
            return True
        return 2 * self.private_copies(tensor) * PAGE_SIZE >= tensor.numel() * tensor.element_size()

    def private_copies(self, tensor: torch.Tensor) -> int:
        """Pages under ``tensor`` that are this process's own copies (``/proc/self/pagemap``):
        in a private file mapping, the pages a write copied."""
        if self._pagemap is None:
            from hostmem.pagemap import PagemapReader  # a merge served from the cache never asks

            self._pagemap = PagemapReader()
        start = tensor.data_ptr()
        return self._pagemap.private_copies(start, start + tensor.numel() * tensor.element_size())
