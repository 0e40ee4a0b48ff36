"""Remap's spill: weights that differ from their checkpoint, written once and mapped back.

:func:`hostmem.remap` can only point a weight at its checkpoint where the bytes are the
checkpoint's. A weight cast at load (an fp32 checkpoint loaded as bf16, or diffusers'
``_keep_in_fp32_modules`` kept in fp32 over a bf16 checkpoint), changed after it, fused
(``fuse_qkv_projections()``'s ``to_qkv``) or computed at load has no such bytes anywhere
on disk, so it stays anonymous: memory a host without swap never gets back. With ``spill=True`` those weights are written once, one
layer file each, into the vault (:mod:`hostmem.vault`: verified, crash-safe, locked,
read-only roots) and replaced by read-only mappings of what was written, so they become
page cache too; the next start with the same bytes finds the files and writes nothing.

Views. Weights that share one storage (one a view of another, or all views of one
buffer) are spilled once: the storage is written as one flat layer file, and each of
them becomes the same view of its mapping, so they still share their bytes.

The key. How a spilled weight was derived (which cast, which fusion) is not something
remap can know, so the key is the content, as for the LoRA cache's merged layers: the
checkpoint's content identity (:func:`hostmem.vault.base_identity`, whole-file digests,
memoised under the root) plus a digest (the vault's BLAKE3 where it has it, else sha256)
of the spilled weights' names, dtypes, shapes and bytes. Any other byte gives another
key, never a stale file; the same bytes from another path, copy or host give the same
one. Hashing the spilled bytes at every start is the price of that honesty: it reads
them once, one weight per core (both hashes release the GIL).

The vault's key parts are named for merges (base, adapters, target dtype, merge
policy): a spill is keyed as a base with no adapters whose policy names the spill
format and the digest of its weights, so ``hostmem cache ls`` shows what it was made of.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from ..safetensors.mapping import tensor_bytes
from ..slots import TensorSlot
from ..units import format_size
from ..vault.content_hash import new_hasher

__all__ = ["SPILL_FORMAT", "SPILLED_REASONS", "Pending", "SpillUnit", "spill_units", "spill", "spill_digest"]

SPILL_FORMAT = "hostmem-remap-spill/1"
SPILLED_REASONS = ("cast", "changed")  # the reasons a weight is left that its own bytes can fix
LABEL = "remap spill cache"


class Pending(NamedTuple):
    """A weight remap left for a reason a spill can fix, and the checkpoint it came from."""

    label: str  # its name, with the component: the layer's name in the vault
    slot: TensorSlot
    reason: str  # "cast", "changed" or "missing" (a parameter fused or computed at load)
    shards: tuple[str, ...]
    origin: str = ""  # what it was, for the report (hostmem.remapping.origin.origin_of)


class SpillUnit(NamedTuple):
    """One layer file: a weight, or the whole storage several pending weights are views of."""

    label: str
    tensor: torch.Tensor  # what is written
    members: tuple[Pending, ...]  # the weights it serves

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def views(self, mapped: torch.Tensor) -> list[torch.Tensor]:
        """Each member's tensor as the same view of ``mapped`` (the layer file's mapping)."""
        if len(self.members) == 1 and self.tensor is self.members[0].slot.tensor:
            return [mapped]
        return [mapped.as_strided(m.slot.tensor.shape, m.slot.tensor.stride(),
                                  mapped.storage_offset() + m.slot.tensor.storage_offset()) for m in self.members]


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def spill_units(pending: list[Pending]) -> list[SpillUnit]:
    """One unit per storage: a weight alone is written as itself; weights sharing a storage
    (of one dtype, which the storage's size divides) are written once, as the flat storage,
    under the name of the largest of them."""
    groups: dict[tuple[int, int], list[Pending]] = {}
    for item in pending:
        groups.setdefault(_storage_key(item.slot.tensor), []).append(item)
    units = []
    for (_, nbytes), items in groups.items():
        dtypes = {i.slot.tensor.dtype for i in items}
        size = items[0].slot.tensor.element_size()
        if len(items) == 1 or len(dtypes) > 1 or nbytes % size:
            units += [SpillUnit(i.label, i.slot.tensor, (i,)) for i in items]
            continue
        owner = max(items, key=lambda i: (i.slot.tensor.numel(), i.label))
        flat = torch.empty(0, dtype=owner.slot.tensor.dtype).set_(
            owner.slot.tensor.untyped_storage(), 0, (nbytes // size,), (1,))
        units.append(SpillUnit(owner.label, flat, tuple(items)))
    return units


def _tensor_digest(label: str, tensor: torch.Tensor) -> tuple[str, str]:
    """The digest of one weight's name, dtype, shape and bytes (the bytes hashed without a
    copy), with the vault's content hash (BLAKE3 where installed)."""
    digest = new_hasher()
    digest.update(f"{label}\0{str(tensor.dtype)}\0{list(tensor.shape)}\0".encode())
    digest.update(tensor_bytes(tensor.detach()))
    return label, digest.hexdigest()


def spill_digest(units: list[SpillUnit]) -> str:
    """One digest over every unit's digest, in name order, as ``"<algorithm>:<hex>"``
    (the weights hashed on all cores: both hashes release the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="hostmem-spill-digest") as pool:
        digests = sorted(pool.map(lambda u: _tensor_digest(u.label, u.tensor), units))
    combined = new_hasher()
    for label, digest in digests:
        combined.update(f"{label}\0{digest}\n".encode())
    return f"{combined.name}:{combined.hexdigest()}"


def _spill_key(vault, units: list[SpillUnit]):
    """The combination's key: the checkpoint's content and the spilled weights' digest."""
    from ..vault import cache_key

    shards = sorted({s for u in units for m in u.members for s in m.shards})
    dtypes = ",".join(sorted({str(u.tensor.dtype).removeprefix("torch.") for u in units}))
    policy = f"{SPILL_FORMAT} {spill_digest(units)}"
    return cache_key(vault.base_identity(shards), [], dtypes, policy)


def _why_not_written(vault, session) -> str:
    """Why a put answered None, in the words of this call."""
    if vault.read_only:
        return (
            f"the cache root {vault.root} is read-only and does not hold these weights; "
            "list a writable root after it (cache_root=[...])"
        )
    return session.last_error or f"the cache in {vault.root} could not take them"


def _serve(session, unit: SpillUnit) -> torch.Tensor | None:
    """The unit's mapped layer file: found in the cache, else written now; None if neither."""
    tensor = unit.tensor.detach()
    view = session.get(unit.label, tuple(tensor.shape), tensor.dtype)
    if view is None:
        view = session.put(unit.label, tensor)
    return view


def spill(pending: list[Pending], report, cache_root=None, max_size=None) -> list[Pending]:
    """Write ``pending`` into the vault (or find them there) and map them back read-only.

    Updates ``report`` (spilled count and bytes, layer bytes written and reused, key,
    root, and why some could not be spilled); returns the weights that stay as they were.
    """
    from ..vault import Vault, cache_roots, open_in_roots
    from ..vault.roots import keyer

    if not pending:
        return []
    vaults = [Vault(root, max_size, label=LABEL) for root in cache_roots(cache_root)]
    units = spill_units(pending)
    key = _spill_key(keyer(vaults), units)  # its memo spares the next start a rehash
    expected = {u.label: (tuple(u.tensor.shape), u.tensor.dtype) for u in units}
    vault, session = open_in_roots(vaults, key, expected)
    left = []
    with session:
        for unit in units:
            view = _serve(session, unit)
            if view is None:
                left += unit.members
                continue
            report.spilled += len(unit.members)
            report.spilled_bytes += unit.nbytes
            for item, new in zip(unit.members, unit.views(view)):
                item.slot.replace(new)
                report.spill_origins[item.label] = item.origin or item.reason
        report.spill_key, report.spill_root = key.hex, vault.root
        report.spill_written_bytes += session.stats["bytes_written"]
        report.spill_reused_bytes += session.stats["bytes_hit"]
        if left:
            report.spill_problem = _why_not_written(vault, session)
    if left:
        warnings.warn(
            f"hostmem.remap: {len(left)} weight(s) ({format_size(sum(p.slot.nbytes for p in left))}) not spilled "
            f"and left anonymous: {report.spill_problem}",
            stacklevel=3,
        )
    return left
