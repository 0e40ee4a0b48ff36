"""A combination: the merge policy, the base shards and the vault key of adapters merged into a base.

What decides the merged bytes, and so the key they are cached under. ``merge``
(:mod:`lora_cache.orchestrate`), the shared build (:mod:`lora_cache.shared_build`) and the
provider's offer (:mod:`lora_cache.provider`) all key a combination here, so they agree,
and none of them imports another for it.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch

from hostmem.errors import InputError
from hostmem.safetensors_header import read_header
from hostmem.vault import CacheKey, cache_key
from hostmem.vault.safety import prepare_root, root_is_read_only

from .adapters import Adapter, AdapterFile
from .kernels import KernelPlan
from .kernels.precision import fp32_matmul_precision
from .layers import AddressSpace, LayerTarget
from .merge_math import compute_device

__all__ = [
    "MERGE_POLICY", "merge_policy", "kernel_roots", "mapped_file", "base_shards", "inputs_but_base", "combination_key",
]

MERGE_POLICY = "fp32-sum-in-row-blocks-in-adapter-order-cast-once-v3"  # change when merged bytes would change


def merge_policy(device: torch.device | str | None = None, kernels: KernelPlan | None = None) -> str:
    """The merge policy as the key records it: :data:`MERGE_POLICY` on the compute device's
    type, the kernel chosen for each shape class that has a choice, and how torch runs
    fp32 matmuls on that device where this process lets it narrow them (TF32, bf16).

    The same fp32 sum can round differently on a GPU (its addmm) and on the CPU, the
    CPU's kernels differ in the last bit of a few elements, and a narrowed fp32 matmul
    rounds an fp32 adapter's factors, so a cache built one way is never served to starts
    that would merge another (see :mod:`lora_cache.kernels`).
    """
    device = torch.device(device) if device is not None else compute_device()
    chosen = kernels.describe() if kernels is not None else ""
    narrowed = fp32_matmul_precision(device.type)
    return (f"{MERGE_POLICY}@{device.type}" + (f"+{chosen}" if chosen else "")
            + ("" if narrowed == "ieee" else f"+fp32-matmul={narrowed}"))


def mapped_file(target: LayerTarget, space: AddressSpace) -> str | None:
    """The file the target's base weight is a mapped view of, or None."""
    area = space.area_of(target.current)
    path = area.path if area is not None and area.is_file else None
    if path is None or not path.startswith("/") or path.endswith(" (deleted)"):
        return None
    return path


def _dotted_suffixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["a.b.c", "b.c", "c"]``."""
    parts = name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _shards_by_header(targets: list[LayerTarget], base_files: list[str]) -> set[str]:
    """The given shards whose headers hold the targets: same shape, and the same name up to
    wrapper prefixes on either side (``dit.blocks.0.w`` / ``model.blocks.0.w`` / ``blocks.0.w``).

    When a target is found in none of them (renamed on load, say), every given shard is
    kept: the key then covers more than it needs, never less.
    """
    exact: dict[str, list[tuple[str, tuple]]] = {}  # tensor name -> (shard, shape)
    ending: dict[str, list[tuple[str, tuple]]] = {}  # every dotted suffix of a tensor name -> (shard, shape)
    for path in base_files:
        for name, info in read_header(path).tensors.items():
            exact.setdefault(name, []).append((path, tuple(info.shape)))
            for suffix in _dotted_suffixes(name):
                ending.setdefault(suffix, []).append((path, tuple(info.shape)))
    found = set()
    for target in targets:
        shape = tuple(target.current.shape)
        shorter = [c for suffix in _dotted_suffixes(target.name)[1:] for c in exact.get(suffix, [])]
        candidates = ending.get(target.name, []) + shorter
        holders = {path for path, held in candidates if held == shape}
        if not holders:
            return set(base_files)
        found |= holders
    return found


def base_shards(targets: list[LayerTarget], base_files: list[str] | None, space: AddressSpace) -> list[str]:
    """The checkpoint shards that hold the targets' base weights: the base part of the key.

    Only those shards decide the merged bytes, so only they enter the key, however the
    merge learns of them, and every way gives the same set: a weight that is a view of a
    mapped file (``hostmem.load_readonly``, safetensors' own mmap, ``hostmem lora
    merge``) names its shard itself; for the others, ``base_files`` (every shard of the
    checkpoint will do) is narrowed to the shards whose headers hold them. A shard
    without targets (the norms, the embeddings) may change without losing the cache.
    """
    files, unplaced = set(), []
    for target in targets:
        path = mapped_file(target, space)
        if path is None:
            unplaced.append(target)
        else:
            files.add(path)
    if unplaced and base_files is None:
        names = [t.name for t in unplaced]
        raise InputError(
            f"cannot tell which checkpoint {len(names)} weight(s) come from ({', '.join(names[:3])}"
            f"{', ...' if len(names) > 3 else ''}): they are not views of a mapped file. Pass "
            "base_files=[the .safetensors shards the model was loaded from], or enabled=False to merge in place"
        )
    if unplaced:
        files |= _shards_by_header(unplaced, [os.path.realpath(os.fspath(p)) for p in base_files])
    return sorted(files)


def _key_extras(adapter: AdapterFile, spec: Adapter) -> dict:
    """Inputs of the merged bytes that the adapter file's content hash does not cover."""
    config = asdict(adapter.config) if adapter.config is not None else None
    rules = [list(r.values()) if isinstance(r, dict) else list(r) for r in spec.rules]
    return {"rules": rules, "rslora": spec.rslora, "peft_config": config, **adapter.key_extras}


def inputs_but_base(vault, files, specs, dtypes, device, kernels, sharding: str) -> tuple[list[dict], str, str]:
    """``(adapter identities, target dtype, merge policy)``: the key's inputs besides the base."""
    identities = [
        {**vault.adapter_identity(f.path, s.strength, s.alpha), **_key_extras(f, s)} for f, s in zip(files, specs)
    ]
    target_dtype = ",".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))
    policy = merge_policy(device, kernels) + (f"+{sharding}" if sharding else "")
    return identities, target_dtype, policy


def combination_key(
    vault, files: list[AdapterFile], specs: list[Adapter], shards: list[str], dtypes, device=None, kernels=None,
    sharding: str = "",
) -> CacheKey:
    """The vault key of merging ``files`` (as ``specs`` ask) into the checkpoint ``shards``
    (the ones holding the targets: :func:`base_shards`), summed on ``device``
    (default: the compute device) by ``kernels`` (see :func:`merge_policy`). ``sharding``
    names the tensor-parallel part the layers are (:meth:`lora_cache.tp_shards.Shard.describe`)."""
    rest = inputs_but_base(vault, files, specs, dtypes, device, kernels, sharding)
    return cache_key(vault.base_identity(shards), *rest)


def kernel_roots(roots: list[str] | None) -> list[str]:
    """The roots whose kernel timings a combination's key is made with: the read-only
    roots listed before the first writable one (their recorded choices win: the keys of
    what they hold were made with them), then that writable root, which keeps new
    timings (none without roots; without a writable root, new timings stay in this
    process). Every entry point asks here (``merge``, ``set_adapters``), so they choose
    the same kernels, and so the same key.

    Each root is checked first as its vault will check it: a refused root (a link to
    tmpfs, another user's folder) is refused before the timings and their lock are
    written in it.
    """
    chosen = []
    for root in roots or []:
        read_only = root_is_read_only(root)
        prepare_root(root, create=not read_only)
        chosen.append(root)
        if not read_only:
            return chosen
    return [*chosen, None] if chosen else []
