"""Layer operations, one job each.

- :func:`compute_merged`: the merged weight of one parameter (a query: no module state).
- :func:`install`: the parameter now holds a merged weight (the only state transition;
  it also records what unmerge needs).
- :func:`merge_in_place`: the path the cache replaces: the merged weight in anonymous
  memory. A writable base is summed into where it lies, as peft's ``merge_and_unload``
  does; its bytes are copied aside first (the unmerge snapshot) only where the caller
  asks to be able to unmerge.
- :func:`unmerge`: where the base was never touched (a cached merge, or any merge over a
  read-only mapping) the snapshot is the original parameter, a zero-copy view of the
  mapped base, and is reinstalled; where it was overwritten, the snapshot's bytes are
  copied back; where no snapshot was kept, it says so and how to merge instead.

Snapshots live in a weak table keyed by module, so a merged model carries no extra
attributes and a dropped model drops its snapshots.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from hostmem.errors import HostmemError
from hostmem.pinning import replaced
from hostmem.safetensors.mapping import open_readonly
from hostmem.safetensors.writers import guard_foreign_writers, register_lora_holder

from ..compute.merge_math import FP32_ROWS, Scratch, merged_weight
from ..targets.layer_target import AddressSpace, LayerTarget, components_of, named_parameters

__all__ = [
    "AddressSpace",
    "UnmergeError",
    "checkpoint_module",
    "module_tree",
    "LayerTarget",
    "Snapshot",
    "components_of",
    "compute_merged",
    "install",
    "is_merged",
    "keep_base",
    "merge_in_place",
    "named_parameters",
    "unmerge",
]


@dataclass(frozen=True)
class Snapshot:
    """What unmerge restores: the original parameter object, or a copy of its bytes, or
    neither (merged in place without a copy: unmerge cannot restore it)."""

    original: nn.Parameter | None = None  # reinstalled as is (cached merge)
    copy: torch.Tensor | None = None  # copied back into the parameter (in-place merge)

    @property
    def kept(self) -> bool:
        return self.original is not None or self.copy is not None


class UnmergeError(HostmemError, RuntimeError):
    """Some merged weights were written over in place without a copy to restore."""


_SNAPSHOTS: "weakref.WeakKeyDictionary[nn.Module, dict[str, Snapshot]]" = weakref.WeakKeyDictionary()


def compute_merged(target: LayerTarget, out: torch.Tensor, scratch: Scratch, workers=None,
                   claim=None, publish=None, kernel: str = FP32_ROWS) -> torch.Tensor:
    """Write the merged weight of ``target`` into ``out``; the module is not touched.

    ``workers`` is a thread pool for the row blocks, ``kernel`` the one chosen for this
    layer (see :mod:`lora_cache.kernels`); ``claim`` and ``publish`` let a caller stream
    ``out`` while it is computed (see :func:`lora_cache.compute.merge_math.merged_weight`).
    """
    if target.shard is not None:  # the deltas are the whole weight's: sum as the whole layer is
        return target.shard.merged(target.current.detach(), target.deltas, out, scratch, workers, claim, publish,
                                   kernel)
    return merged_weight(target.current.detach(), target.deltas, out, scratch, workers, claim, publish, kernel)


def install(target: LayerTarget, merged: torch.Tensor, snapshot: Snapshot) -> None:
    """Make ``target`` hold ``merged`` (a view of a read-only mapping from the cache, or an
    anonymous tensor of its own): the one place where a parameter is replaced."""
    old = target.module._parameters[target.attr]
    target.module._parameters[target.attr] = nn.Parameter(merged, requires_grad=False)
    replaced(old, target.module._parameters[target.attr])  # a pin on the base follows it
    _remember(target, snapshot)


def _remember(target: LayerTarget, snapshot: Snapshot) -> None:
    """Record what unmerge restores (the first snapshot recorded for a parameter stands);
    diffusers' "LoRA off" calls are guarded from then on (:func:`_holds_merge`)."""
    guard_foreign_writers()
    _SNAPSHOTS.setdefault(target.module, {}).setdefault(target.attr, snapshot)


def _holds_merge(module: nn.Module) -> bool:
    """Whether ``module`` holds a merged weight, for diffusers' ``unfuse_lora`` and the like to
    refuse rather than return with the merge still on
    (:func:`hostmem.safetensors.writers.register_lora_holder`)."""
    return bool(_SNAPSHOTS.get(module))


register_lora_holder(_holds_merge)


def keep_base(target: LayerTarget) -> None:
    """Record that ``target`` is served on its base as it is (its terms added at run time,
    :mod:`lora_cache.placement.rounding`): the model counts as merged, and unmerge reinstalls it."""
    _remember(target, Snapshot(original=target.current))


def merge_in_place(target: LayerTarget, scratch: Scratch, workers=None, kernel: str = FP32_ROWS,
                   where_it_lies: bool = True, keep_copy: bool = False) -> None:
    """Merge ``target`` into anonymous memory: the path the cache replaces.

    ``where_it_lies`` (:meth:`AddressSpace.sums_where_it_lies`: a heap tensor, a private
    mapping already copied) sums the base into its own bytes, block by block, so the
    merge costs the layer's bytes and nothing more, as peft's ``merge_and_unload``; with
    ``keep_copy`` its bytes are copied aside first, for :func:`unmerge`, which doubles
    that. Otherwise (a read-only mapping, a private file mapping not copied yet) the
    merged weight goes to a new tensor: the same anonymous bytes without copying the
    file's pages on write, and the base, untouched, is its own snapshot (page cache, no
    copy).
    """
    current = target.current.detach()
    if where_it_lies:
        snapshot = Snapshot(copy=current.clone()) if keep_copy else Snapshot()
        with torch.no_grad():
            compute_merged(target, current, scratch, workers, kernel=kernel)
        _remember(target, snapshot)
    else:
        merged = compute_merged(target, torch.empty_like(current, memory_format=torch.contiguous_format),
                                scratch, workers, kernel=kernel)
        install(target, merged, Snapshot(original=target.current))


def is_merged(model) -> bool:
    """True when any module of ``model`` holds a merged weight."""
    return any(_SNAPSHOTS.get(m) for root in components_of(model).values() for m in root.modules())


def unmerge(model, strict: bool = True) -> int:
    """Restore every merged parameter of ``model``; return how many were restored.

    Bit for bit: a cached merge reinstalls the original parameter (its base never
    changed; cast or moved as the model was since, ``model.to(...)``), an in-place merge
    copies the snapshot's bytes back. A parameter merged in
    place without a snapshot cannot be restored: it is left merged (the model still
    counts as merged) and, with ``strict``, :class:`UnmergeError` says which and how to
    merge so that unmerge works, once the others are restored.
    """
    restored, lost = 0, []
    for component, root in components_of(model).items():
        for module_name, module in root.named_modules():
            snapshots = _SNAPSHOTS.pop(module, {})
            for attr, snapshot in snapshots.items():
                if not snapshot.kept:
                    lost.append(".".join(p for p in (component, module_name, attr) if p))
                    _SNAPSHOTS.setdefault(module, {})[attr] = snapshot
                elif snapshot.copy is not None:
                    with torch.no_grad():
                        module._parameters[attr].copy_(snapshot.copy)
                    restored += 1
                else:
                    merged, base = module._parameters[attr], snapshot.original
                    if (base.dtype, base.device) != (merged.dtype, merged.device):  # moved or cast since
                        base = nn.Parameter(base.detach().to(device=merged.device, dtype=merged.dtype),
                                            requires_grad=merged.requires_grad)  # the base as the model now has it
                    module._parameters[attr] = base
                    replaced(merged, base)  # a pin on the merged weight follows it back
                    restored += 1
    if lost and strict:
        raise UnmergeError(
            f"{len(lost)} weight(s) were merged in place without a copy of their base ({', '.join(lost[:3])}"
            f"{', ...' if len(lost) > 3 else ''}), so they cannot be unmerged: reload the model. To be able "
            "to unmerge, merge with lora_cache.merge(..., unmergeable=True), or through the cache "
            "(cache_root=...), whose merged weights leave the base untouched"
        )
    return restored


def module_tree(tensors) -> nn.Module:
    """A module tree holding ``(name, tensor)`` pairs as parameters, named like the tensors.

    Tensor ``blocks.0.attn.to_q.weight`` becomes parameter ``weight`` of module
    ``blocks.0.attn.to_q``, exactly where the model class would put it, so adapters
    resolve against it as against the model.
    """
    root = nn.Module()
    for name, tensor in tensors:
        *parents, attr = name.split(".")
        module = root
        for part in parents:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(attr, nn.Parameter(tensor, requires_grad=False))
    return root


def checkpoint_module(shard_paths: list[str]) -> nn.Module:
    """A checkpoint's tensors as read-only mapped parameters of a :func:`module_tree`.

    Lets a cache be built ahead of time (``hostmem lora merge``) without the model's class.
    """
    mapped = [open_readonly(path) for path in shard_paths]
    return module_tree((name, m.get_tensor(name)) for m in mapped for name in m.keys())
