"""A combination: the merge policy and the vault key of adapters merged into a base.

What decides the merged bytes, and so the key they are cached under. ``merge``
(:mod:`lora_cache.orchestrate`), the shared build (:mod:`lora_cache.ranks.shared_build`) and the
provider's offer (:mod:`lora_cache.provider`) all key a combination here, so they agree,
and none of them imports another for it.
"""

from __future__ import annotations

import torch

from hostmem.vault import CacheKey, cache_key
from hostmem.vault.safety import prepare_root, root_is_read_only

from .adapters import Adapter, AdapterFile
from .canonical_key import adapter_forms
from .kernels import KernelPlan
from .kernels.precision import fp32_matmul_precision
from .merge_math import compute_device

__all__ = [
    "MERGE_POLICY", "merge_policy", "kernel_roots", "inputs_but_base", "combination_key",
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


def _key_extras(spec: Adapter, form: str) -> dict:
    """Inputs of the merged bytes that the adapter file's content hash does not cover: the
    user's key rules and the canonical form's digest (:mod:`lora_cache.canonical_key`),
    which holds every scale, whatever reader or config gave it, and names no reader."""
    rules = [list(r.values()) if isinstance(r, dict) else list(r) for r in spec.rules]
    return {"rules": rules, "form": form}


def inputs_but_base(vault, files, specs, dtypes, device, kernels, sharding: str, rounding: str = "runtime", *,
                    planned) -> tuple[list[dict], str, str]:
    """``(adapter identities, target dtype, merge policy)``: the key's inputs besides the base.
    ``planned``: ``{layer name: deltas}`` of every target, the canonical form the key covers.

    A merge that merges lossy layers anyway (``rounding="merge"``) is keyed apart: a
    start under the default policy that plans from conversion records cannot measure,
    and must never find those layers merged (:mod:`lora_cache.rounding`)."""
    forms = adapter_forms(planned, [f.path for f in files])
    identities = [{**vault.adapter_identity(f.path, s.strength, s.alpha), **_key_extras(s, form)}
                  for f, s, form in zip(files, specs, forms)]
    target_dtype = ",".join(sorted({str(d).removeprefix("torch.") for d in dtypes}))
    policy = merge_policy(device, kernels) + (f"+{sharding}" if sharding else "")
    policy += "" if rounding == "runtime" else f"+rounding={rounding}"
    return identities, target_dtype, policy


def combination_key(
    vault, files: list[AdapterFile], specs: list[Adapter], shards: list[str], dtypes, device=None, kernels=None,
    sharding: str = "", *, planned,
) -> CacheKey:
    """The vault key of merging ``files`` (as ``specs`` ask) into the checkpoint ``shards``
    (the ones holding the targets: :func:`lora_cache.base_shards.base_shards`), summed on
    ``device`` (default: the compute device) by ``kernels`` (see :func:`merge_policy`).
    ``sharding`` names the tensor-parallel part the layers are
    (:meth:`lora_cache.ranks.tp_shards.Shard.describe`); ``planned`` the targets' deltas by layer
    name (:mod:`lora_cache.canonical_key`)."""
    rest = inputs_but_base(vault, files, specs, dtypes, device, kernels, sharding, planned=planned)
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
