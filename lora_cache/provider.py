"""The planner's provider: what the LoRA merge cache gives back to the host budget.

An in-place merge leaves every merged layer anonymous and keeps an unmerge snapshot
of the same size, so it commits ``2 x lora target bytes`` of memory the kernel cannot
reclaim. The cached merge keeps both file-backed. The offer says so, with the disk
the cache needs and the one-time cost of building it (none when it is already built).

The offer has the fields of :class:`hostmem.providers.OfferRecord`, the protocol every
provider meets, and one more; nothing here imports ``planners``.
"""

from __future__ import annotations

import math
import os
from collections import namedtuple
from typing import NamedTuple

from hostmem.errors import InputError
from hostmem.providers import OFFER_FIELDS
from hostmem.safetensors.header import read_header
from hostmem.units import format_rate, format_size

from .targets.header_targets import NeedsReader, header_targets
from .settings import cache_disabled_by_env

__all__ = ["LoraCacheOffer", "LoraCacheProvider", "TargetLayers", "target_layers", "DEFAULT_BUILD_RATE"]

# Merge + durable write on a CPU host; bench/bench_lora.py measures the real figure.
DEFAULT_BUILD_RATE = 300 * 1024 * 1024


# Bytes a layer file adds to its tensor: the vault pads each header to one page so the
# data starts page-aligned (tests/lora_cache/test_provider.py holds the two together).
LAYER_FILE_OVERHEAD = 4096


class LoraCacheOffer(namedtuple("LoraCacheOffer", [*OFFER_FIELDS, "transient_bytes"], defaults=(0,))):
    """Anonymous bytes the cache turns into mapped ones, and what that costs; beside an
    offer's fields, ``transient_bytes``: the one-layer buffers a cached merge holds while it runs."""

    __slots__ = ()


class TargetLayers(NamedTuple):
    """The parameters a set of adapters changes, from headers: count, bytes, largest.

    ``read_with_torch`` says why the adapters were read with the full reader (which
    imports torch) rather than from their headers alone; None when they were not.
    ``converted`` says how files only diffusers' converter maps were read (by the
    converter, or from the conversion records a merge left); None when none was.
    A NamedTuple, not a dataclass: a plan by path builds no dataclass it can spare.
    """

    names: tuple[str, ...]
    nbytes: int
    largest_numel: int
    largest_nbytes: int
    cache_key: str | None = None
    cached: bool = False
    read_with_torch: str | None = None
    converted: str | None = None


def target_layers(shard_paths: list[str], adapters, cache_root=None, *,
                  model_class: str | None = None, memo_roots=None, headers=None) -> TargetLayers:
    """Resolve ``adapters`` against a checkpoint's headers (no weight is read).

    The common layouts are read from the adapters' headers, without torch
    (:mod:`lora_cache.targets.header_targets`); the rest, and a lookup in ``cache_root`` (an
    existing cache folder, or an ordered list of them as the merge takes: is this exact
    combination built in one of them? its key covers the adapters' values), go through
    the merge's own reader. For a diffusers model
    (``model_class``, the ``_class_name`` of its folder's config.json) a file only
    diffusers' converter maps is read as the merge reads it: from its conversion record
    under ``memo_roots`` (the merge's cache roots; None: the default root, as for the
    merge; ``()``: none) without torch, else by the converter
    (:mod:`lora_cache.targets.planned_conversion`). ``headers``: the shards' headers when the
    caller has read them already (``read_header`` of each of ``shard_paths``, in order).
    """
    infos, holder = {}, {}
    for path, header in zip(shard_paths, headers or [read_header(p) for p in shard_paths]):
        infos.update(header.tensors)
        holder.update(dict.fromkeys(header.tensors, path))
    given = [] if cache_root is None else [cache_root] if isinstance(cache_root, (str, os.PathLike)) else cache_root
    roots = [r for r in (os.path.expanduser(os.fspath(r)) for r in given) if os.path.isdir(r)]
    key, cached, why, converted, loader = None, False, None, None, None
    if not roots:
        shapes = {n: i.shape for n, i in infos.items()}
        try:
            names = header_targets(adapters, shapes)
        except NeedsReader as exc:
            names, why = None, str(exc)
            if model_class is not None:
                names, converted, loader = _converted_targets(adapters, shapes, model_class, memo_roots)
                why = None if loader is None and names is not None else why
    else:
        names, why = None, f"the key of a cached combination in {', '.join(roots)} covers the adapters' values"
    if names is None:
        names, key, cached = _read_targets(infos, holder, adapters, roots, loader)
    chosen = [infos[name] for name in names]
    return TargetLayers(
        names=tuple(names),
        nbytes=sum(i.nbytes for i in chosen),
        largest_numel=max((math.prod(i.shape) for i in chosen), default=0),
        largest_nbytes=max((i.nbytes for i in chosen), default=0),
        cache_key=key,
        cached=cached,
        read_with_torch=why,
        converted=converted,
    )


def _converted_targets(adapters, shapes: dict, model_class: str, memo_roots):
    """``(names or None, how they were read, loader or None)`` for a diffusers model: the
    conversion records' names (no torch), else the loader to convert with (names None)."""
    from hostmem.vault.combinations import default_cache_root

    from .targets.planned_conversion import loader_for, recorded_targets

    roots = [os.path.expanduser(os.fspath(r)) for r in ((default_cache_root(),) if memo_roots is None else memo_roots)]
    found = recorded_targets(adapters, shapes, [r for r in roots if os.path.isdir(r)])
    if found is not None:
        return found[0], f"from diffusers' conversion records under {found[1]} (no torch)", None
    loader = loader_for(model_class)
    if loader is None:
        return None, None, None
    return None, f"by diffusers' {loader.__name__} converter for {model_class}, as the merge reads them", loader


def _read_targets(infos: dict, holder: dict, adapters, roots: list[str], loader=None):
    """``(names, key, cached)`` by the merge's own reader and planner (imports torch); with
    ``loader``, files diffusers reads go through its converter, as into a diffusers model.
    The key is made as a start with ``roots`` makes it (the keyer vault's memo, every root's
    recorded kernel choices), and is cached when any of them holds it complete."""
    from .adapters import as_adapters, read_adapter
    from .adapters.for_model import read_adapters
    from .targets.keys import ModuleIndex, plan_deltas
    from .kernels import plan_kernels
    from .kernels.policy import merge_policy
    from .key.combination import kernel_roots, key_of
    from hostmem.vault import Vault
    from hostmem.vault.roots import keyer

    specs = as_adapters(adapters)
    files = read_adapters(None, specs, loader=loader) if loader is not None else [read_adapter(s.path) for s in specs]
    planned = plan_deltas(list(zip(files, specs)), ModuleIndex({n: i.shape for n, i in infos.items()}))
    key, cached = None, False
    if roots and planned:
        vaults = [Vault(root) for root in roots]
        shards = sorted({holder[name] for name in planned})  # the key covers the shards holding targets
        layers = ((infos[name].shape, infos[name].torch_dtype, deltas) for name, deltas in planned.items())
        kernels = plan_kernels(layers, None, kernel_roots(roots))  # the key names the kernels a build would use
        key = key_of(keyer(vaults), files, specs, shards, {infos[n].torch_dtype for n in planned},
                     merge_policy(None, kernels), planned=planned).hex
        cached = any(c.key == key and c.complete for vault in vaults for c in vault.combinations())
    return tuple(planned), key, cached


class LoraCacheProvider:
    """Offers the cached LoRA merge of one component to the planner.

    ``lora_target_bytes`` is what the adapters change (declared in the config, or from
    :func:`target_layers`); ``layers`` and ``largest_layer_bytes`` size the build's
    transient buffers; ``cached=True`` when the combination is already on disk.
    """

    name = "lora_cache"

    def __init__(
        self,
        component: str,
        lora_target_bytes: int,
        *,
        layers: int = 0,
        largest_layer_bytes: int = 0,
        largest_layer_numel: int = 0,
        cached: bool = False,
        enabled: bool = True,
        build_rate: float = DEFAULT_BUILD_RATE,
        in_place_bytes: int | None = None,
    ):
        if lora_target_bytes < 0:
            raise InputError(f"lora target bytes of {component!r} must not be negative, got {lora_target_bytes}")
        self.component = component
        self.lora_target_bytes = int(lora_target_bytes)
        self.layers = layers
        self.largest_layer_bytes = largest_layer_bytes
        self.largest_layer_numel = largest_layer_numel
        self.cached = cached
        self.enabled = enabled and not cache_disabled_by_env()
        self.build_rate = build_rate
        # What the in-place merge commits: 2 x targets over weights loaded copied (merged layers +
        # unmerge snapshot); the planner passes its own prediction so one report has one price.
        self.in_place_bytes = 2 * self.lora_target_bytes if in_place_bytes is None else int(in_place_bytes)

    @classmethod
    def from_checkpoint(cls, component: str, shard_paths: list[str], adapters, cache_root=None, **kwargs):
        """Size the offer from the checkpoint's headers and the adapter files."""
        found = target_layers(shard_paths, adapters, cache_root)
        return cls(
            component,
            found.nbytes,
            layers=len(found.names),
            largest_layer_bytes=found.largest_nbytes,
            largest_layer_numel=found.largest_numel,
            cached=found.cached,
            **kwargs,
        )

    def offer(self) -> LoraCacheOffer | None:
        """The offer, or None when the cache is off or there is nothing to merge."""
        if not self.enabled or self.lora_target_bytes == 0:
            return None
        targets = self.lora_target_bytes
        disk = 0 if self.cached else targets + self.layers * LAYER_FILE_OVERHEAD
        seconds = 0.0 if self.cached else targets / self.build_rate
        transient = self.largest_layer_numel * 4 + self.largest_layer_bytes
        if self.cached:
            how = "already built: a start maps it back, no merge"
        else:
            how = f"built once in about {seconds:.0f} s at {format_rate(self.build_rate)}, then reused"
        in_place = self.in_place_bytes
        parts = "merged weights + unmerge snapshot" if in_place > targets else "merged weights"
        note = (
            f"LoRA merge of {format_size(targets)} in {self.component}: in place it costs "
            f"{format_size(in_place)} anonymous ({parts}); cached it stays "
            f"file-backed ({format_size(disk)} of disk; {how})"
        )
        return LoraCacheOffer(self.name, self.component, in_place, disk, seconds, note, transient)

    def __repr__(self) -> str:
        return (
            f"LoraCacheProvider({self.component!r}, {format_size(self.lora_target_bytes)}, "
            f"cached={self.cached}, enabled={self.enabled})"
        )
