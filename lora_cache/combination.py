"""A combination: the merge policy and the vault key of adapters merged into a base.

What decides the merged bytes, and so the key they are cached under. ``merge``
(:mod:`lora_cache.orchestrate`), the shared build (:mod:`lora_cache.ranks.shared_build`) and the
provider's offer (:mod:`lora_cache.provider`) all key a combination here, so they agree,
and none of them imports another for it.
"""

from __future__ import annotations

import hashlib
import json

import torch

from hostmem.vault import CacheKey, cache_key
from hostmem.vault.records import CONVERSIONS
from hostmem.vault.shelf import Shelf
from hostmem.vault.safety import prepare_root, root_is_read_only

from .adapters import Adapter, AdapterFile
from .canonical_key import adapter_forms, adapter_meanings
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


def _rules(spec: Adapter) -> list:
    return [list(r.values()) if isinstance(r, dict) else list(r) for r in spec.rules]


def _key_extras(spec: Adapter, form: str) -> dict:
    """Where an adapter's meaning is not known (see :func:`_identity`): the inputs of the
    merged bytes that the file's content hash does not cover, the user's key rules and the
    canonical form's digest (:mod:`lora_cache.canonical_key`)."""
    return {"rules": _rules(spec), "form": form}


_MEANINGS: dict[str, str] = {}  # memo name -> meaning, in this process
_MEANING_FORMAT, _MEANING_VERSION = "lora-cache-adapter-meaning", 1


def _meaning_name(file_digest: str, form: str, adapter: AdapterFile, spec: Adapter) -> str:
    """What a meaning is remembered by: the file's content, its form (targets, scales,
    shapes), its reader (a converter's values may differ from the file's) and the key rules
    (which rows of a fused factor land where)."""
    inputs = {"digest": file_digest, "form": form, "reader": adapter.key_extras, "rules": _rules(spec)}
    return "meaning-" + hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def _remembered(vault, names: list[str]) -> list[str | None]:
    shelf = Shelf([vault], CONVERSIONS)
    valid = (lambda r: isinstance(r, dict) and r.get("format") == _MEANING_FORMAT
             and r.get("version") == _MEANING_VERSION and isinstance(r.get("meaning"), str))
    out = []
    for name in names:
        if name not in _MEANINGS:
            record = shelf.load(name, valid)
            if record is not None:
                _MEANINGS[name] = record["meaning"]
        out.append(_MEANINGS.get(name))
    return out


def _remember(vault, name: str, file_digest: str, meaning: str) -> None:
    """Keep a meaning in this process and, as a record of the file (pruned with it), in the
    root (a hint: a root that cannot hold it costs the next start a hash of the values)."""
    if _MEANINGS.get(name) == meaning:
        return
    _MEANINGS[name] = meaning
    Shelf([vault], CONVERSIONS).store(name, {"format": _MEANING_FORMAT, "version": _MEANING_VERSION,
                                             "digest": file_digest, "meaning": meaning})


def _identities(vault, files, specs, planned) -> list[dict]:
    """Each adapter's identity in the key: its meaning (``digest``; the file's content digest
    beside it as ``file_digest``, which the key leaves out), its strength and alpha override;
    where the meaning is neither remembered nor computable (values on the meta device), the
    file's content digest with the key rules and the form."""
    paths = [f.path for f in files]
    forms = adapter_forms(planned, paths)
    found = [vault.adapter_identity(f.path, s.strength, s.alpha) for f, s in zip(files, specs)]
    names = [_meaning_name(i["digest"], form, f, s) for i, form, f, s in zip(found, forms, files, specs)]
    meanings = adapter_meanings(planned, paths, _remembered(vault, names))
    out = []
    for identity, spec, form, name, meaning in zip(found, specs, forms, names, meanings):
        if meaning is None:
            out.append({**identity, **_key_extras(spec, form)})
            continue
        _remember(vault, name, identity["digest"], meaning)
        out.append({**identity, "file_digest": identity["digest"], "digest": meaning})
    return out


def inputs_but_base(vault, files, specs, dtypes, device, kernels, sharding: str, rounding: str = "runtime", *,
                    planned) -> tuple[list[dict], str, str]:
    """``(adapter identities, target dtype, merge policy)``: the key's inputs besides the base.
    ``planned``: ``{layer name: deltas}`` of every target, the canonical form the key covers.

    A merge that merges lossy layers anyway (``rounding="merge"``) is keyed apart: a
    start under the default policy that plans from conversion records cannot measure,
    and must never find those layers merged (:mod:`lora_cache.rounding`)."""
    identities = _identities(vault, files, specs, planned)
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
