"""Where each shard a rank holds is merged: the whole layer's file, or a file of its own.

:func:`split_shards` sorts a merge's targets once the adapters are resolved against the
whole shapes: a target the rank holds whole is merged as always; a contiguous shard
(rows of a column-parallel weight) whose whole weight the checkpoint has is merged as
that whole layer, under the same key as a single-process merge (so the ranks of a host
build it once, together, and each maps its rows of the one file); any other shard (the
columns of a row-parallel weight) is merged on its own into a combination whose key
names the sharding. With the cache off, and on a GPU, every shard is merged in place,
as its part of the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...compute.buffers import compute_device
from ...kernels import KernelPlan, plan_kernels
from ...placement.layers import Snapshot, install, unmerge
from ...placement.runtime_lora import remove_runtime
from ...targets.layer_target import AddressSpace, LayerTarget
from .full_base import WholeWeights
from .spec import Shard

__all__ = ["ShardPlan", "split_shards"]


@dataclass
class ShardPlan:
    """A merge's targets sorted by where they are merged (see the module's docstring)."""

    targets: list[LayerTarget] = field(default_factory=list)  # merged as merge() merges: whole, or in place
    views: list[tuple[LayerTarget, LayerTarget]] = field(default_factory=list)  # (the rank's part, its whole layer)
    apart: dict[Shard, list[LayerTarget]] = field(default_factory=dict)  # merged into a file of their own
    _shards: list[LayerTarget] = field(default_factory=list)  # every target summed as a shard

    def choose_kernels(self, device, root) -> KernelPlan:
        """The kernel plan of the whole layers (the key names it, as a single-process merge's),
        and each shard fixed to its whole layer's kernel, so that its bytes are that layer's."""
        layers = [(t.deltas[0].shape, t.current.dtype, t.deltas) if t.shard is not None
                  else (tuple(t.current.shape), t.current.dtype, t.deltas)
                  for t in self.targets + self._apart_targets()]
        device = torch.device(device) if device is not None else compute_device()
        kernels = plan_kernels(layers, device, root)
        for target in self._shards:
            target.kernel = kernels.kernel_for(tuple(target.deltas[0].shape), target.current.dtype, target.deltas,
                                               device)
        return kernels

    def _apart_targets(self) -> list[LayerTarget]:
        return [t for group in self.apart.values() for t in group]

    def finish(self, model, stats, merge_apart) -> None:
        """Install each rank's rows of its whole merged layers, then merge the shards kept
        apart, one combination per sharding (``merge_apart(targets, sharding)`` returns
        its stats); counted into ``stats``. A failure leaves the model as it was."""
        try:
            space = AddressSpace()
            for part, whole in self.views:
                install(part, _rows_of(whole, part.shard, space), Snapshot(original=part.current))
            for shard, group in self.apart.items():
                _add(stats, merge_apart(group, shard.describe()), shard.describe())
        except BaseException:
            remove_runtime(model)  # the terms of lossy layers kept at run time come off too
            unmerge(model, strict=False)
            raise


def _rows_of(whole: LayerTarget, shard: Shard, space: AddressSpace):
    """The shard's rows of the whole merged layer: a view at an offset of its mapped file
    (a copy where the whole layer was merged in place because the cache could not store it)."""
    merged = whole.current.detach()
    own = shard.bounds(tuple(merged.shape))
    rows = merged.narrow(shard.dim, own.start, own.stop - own.start)
    area = space.area_of(merged)
    return rows if area is not None and area.is_file else rows.clone()


def _add(stats, apart, sharding: str) -> None:
    """Count a shard combination's merge into the merge's stats."""
    for name in ("layers", "hit", "built", "fallen_back", "in_place", "bytes", "bytes_written", "seconds"):
        setattr(stats, name, getattr(stats, name) + getattr(apart, name))
    if apart.cache_key:
        stats.shard_keys[sharding] = apart.cache_key
        if stats.cache_key is None:
            stats.cache_key, stats.cache_root = apart.cache_key, apart.cache_root


def _whole_layer(target: LayerTarget, whole) -> LayerTarget:
    """The whole layer ``target`` is a part of, over a stand-in module holding the mapped
    whole base: merged (or found) under the model's name, as a single-process merge does."""
    holder = nn.Module()
    holder.register_parameter("weight", nn.Parameter(whole, requires_grad=False))
    return LayerTarget(target.name, holder, "weight", target.deltas)


def split_shards(targets: list[LayerTarget], cached: bool, base_files) -> ShardPlan:
    """Sort ``targets`` (from ``plan_targets`` with ``shards``: a part's target carries its
    :class:`Shard` and the whole layer's deltas) by where each is merged: see
    :class:`ShardPlan`. ``cached``: whether the merge goes through the cache at all."""
    plan, wholes = ShardPlan(), WholeWeights(base_files, AddressSpace())
    for target in targets:
        shard = target.shard
        if shard is None:
            plan.targets.append(target)
            continue
        if not cached or target.current.device.type != "cpu":
            plan.targets.append(target)
            plan._shards.append(target)
            continue
        whole = wholes.find(target.name, target.current.detach(), shard) \
            if shard.contiguous(tuple(target.deltas[0].shape)) else None
        if whole is not None:
            stand_in = _whole_layer(target, whole)
            plan.targets.append(stand_in)
            plan.views.append((target, stand_in))
        else:
            plan.apart.setdefault(shard, []).append(target)
            plan._shards.append(target)
    return plan
