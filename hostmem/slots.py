"""Where a model keeps its tensors, and whether their bytes lie in a read-only mapping.

Remapping a weight and making one writable both replace a tensor everywhere a model
holds it: a tied weight is one Parameter held by two modules, and replacing it in
one alone would leave the old bytes alive (and the two copies apart). :func:`tensor_slots`
groups every place by the tensor object, so each tensor is replaced once, in all its
places. :class:`MappedAreas` answers "is this tensor a view of a read-only file
mapping?" from /proc/self/maps, read once: a write there would fault.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterator, Mapping

import torch
from torch import nn

from .pinning import replaced
from .procfs import Vma
from .procfs.files import proc_path, read_text
from .procfs.maps import parse_maps_line, strip_deleted
from .procfs.mounts import SHMEM_NAMES, is_shmem_fs, read_mounts

__all__ = ["TensorSlot", "tensor_slots", "model_components", "iter_module_slots", "MappedAreas"]


@dataclass(eq=False)
class TensorSlot:
    """One tensor of a model and every ``(module, kind, attr)`` that holds it."""

    name: str  # the first qualified name it was found under, within its component
    tensor: torch.Tensor
    places: list[tuple[nn.Module, str, str]] = field(default_factory=list)  # kind: _parameters | _buffers

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def replace(self, new: torch.Tensor) -> None:
        """Make every place hold ``new`` (a Parameter where a Parameter was); a pin on the
        old tensor follows it (:func:`hostmem.pinning.replaced`)."""
        old = self.tensor
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for module, kind, attr in self.places:
            getattr(module, kind)[attr] = new
        self.tensor = new
        replaced(old, new)


def model_components(model) -> dict[str, nn.Module]:
    """``{"": module}``, a dict of named modules, or a pipeline's module components.

    A pipeline is anything with a ``components`` mapping (diffusers' ``DiffusionPipeline``);
    its entries that are not modules (a scheduler, a tokenizer) hold no weights.
    """
    if isinstance(model, nn.Module):
        return {"": model}
    if isinstance(model, Mapping):
        bad = [k for k, v in model.items() if not isinstance(v, nn.Module)]
        if bad:
            raise TypeError(f"components {bad} are not torch.nn.Module")
        return dict(model)
    components = getattr(model, "components", None)
    if isinstance(components, Mapping):
        return {k: v for k, v in components.items() if isinstance(v, nn.Module)}
    raise TypeError(
        f"expected an nn.Module, a dict of named modules or a pipeline with .components, not {type(model).__name__}"
    )


def tensor_slots(module: nn.Module) -> list[TensorSlot]:
    """Every parameter and buffer of ``module``, one slot per tensor object, in module order."""
    slots: dict[int, TensorSlot] = {}
    for module_name, owner in module.named_modules(remove_duplicate=False):
        for kind in ("_parameters", "_buffers"):
            for attr, tensor in getattr(owner, kind).items():
                if tensor is None:
                    continue
                slot = slots.get(id(tensor))
                if slot is None:
                    slot = slots[id(tensor)] = TensorSlot(f"{module_name}.{attr}" if module_name else attr, tensor)
                if not any(m is owner and a == attr for m, _, a in slot.places):
                    slot.places.append((owner, kind, attr))
    return list(slots.values())


class MappedAreas:
    """This process's memory areas from /proc/self/maps, read once, to place tensors.

    Paths and permissions are all it asks, so it reads maps, not smaps (whose page walk
    costs tens of milliseconds per resident GiB). Read it again after mapping new files.
    """

    def __init__(self):
        # Only each line's range is parsed up front; an area becomes a Vma when asked for
        # (a process with a model mapped layer by layer has hundreds of areas, and a
        # merge asks for a few dozen of them).
        self._lines = [line for line in read_text(proc_path(None, "maps")).splitlines() if line]
        ranges = [line[: line.index(" ")].split("-") for line in self._lines]
        self._starts = [int(start, 16) for start, _ in ranges]
        self._ends = [int(end, 16) for _, end in ranges]
        self._parsed: dict[int, Vma] = {}
        self._mounts = None  # read on the first question about a file's filesystem

    def area_at(self, address: int) -> Vma | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i < 0 or not self._starts[i] <= address < self._ends[i]:
            return None
        area = self._parsed.get(i)
        if area is None:
            area = self._parsed[i] = parse_maps_line(self._lines[i])
        return area

    def area_of(self, tensor: torch.Tensor) -> Vma | None:
        if tensor.device.type != "cpu" or tensor.untyped_storage().nbytes() == 0:
            return None
        return self.area_at(tensor.untyped_storage().data_ptr())

    def read_only_file(self, tensor: torch.Tensor) -> str | None:
        """The file ``tensor`` is a read-only mapped view of (a write would fault), or None."""
        area = self.area_of(tensor)
        if area is None or "w" in area.perms or not (area.path or "").startswith("/"):
            return None
        return area.path

    def read_only_page_cache(self, tensor: torch.Tensor) -> str | None:
        """:meth:`read_only_file`, where that file's pages are page cache the kernel can
        drop: not a file on tmpfs or /dev/shm, nor a memfd or SysV segment, whose pages
        are shmem (held in memory until the file goes)."""
        path = self.read_only_file(tensor)
        return path if path is not None and self._page_cache(path) else None

    def copy_on_write_page_cache(self, tensor: torch.Tensor) -> str | None:
        """The file ``tensor`` is a view of a private, writable mapping of (as safetensors
        maps a file: a write copies the page), where that file's pages are page cache; or None."""
        area = self.area_of(tensor)
        if area is None or not area.perms.startswith("rw") or area.perms[3:4] != "p":
            return None
        path = area.path or ""
        return path if path.startswith("/") and self._page_cache(path) else None

    def _page_cache(self, path: str) -> bool:
        if path.startswith(SHMEM_NAMES):
            return False
        if self._mounts is None:
            self._mounts = read_mounts()
        return not is_shmem_fs(strip_deleted(path), self._mounts)


def iter_module_slots(model) -> Iterator[tuple[str, TensorSlot]]:
    """``(component, slot)`` for every tensor of every component of ``model``; slot names
    are the component's own (as its checkpoint names them), without the component."""
    for component, module in model_components(model).items():
        for slot in tensor_slots(module):
            yield component, slot
