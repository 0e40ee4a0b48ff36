"""Remap's spill: weights that differ from their checkpoint, written once and mapped back.

:func:`hostmem.remap` can only point a weight at its checkpoint where the bytes are the
checkpoint's. A weight cast at load (an fp32 checkpoint loaded as bf16, or diffusers'
``_keep_in_fp32_modules`` kept in fp32 over a bf16 checkpoint) or changed after it (a
fused weight) has no such bytes anywhere on disk, so it stays anonymous: memory a host
without swap never gets back. With ``spill=True`` those weights are written once, one
layer file each, into the vault (:mod:`hostmem.vault`: verified, crash-safe, locked,
read-only roots) and replaced by read-only mappings of what was written, so they become
page cache too; the next start with the same bytes finds the files and writes nothing.

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

from .safetensors_map import tensor_bytes
from .slots import TensorSlot
from .units import format_size
from .vault.content_hash import new_hasher

__all__ = ["SPILL_FORMAT", "SPILLED_REASONS", "Pending", "spill", "spill_digest"]

SPILL_FORMAT = "hostmem-remap-spill/1"
SPILLED_REASONS = ("cast", "changed")  # the reasons a weight is left that its own bytes can fix
LABEL = "remap spill cache"


class Pending(NamedTuple):
    """A weight remap left for a reason a spill can fix, and the checkpoint it came from."""

    label: str  # its name, with the component: the layer's name in the vault
    slot: TensorSlot
    reason: str  # "cast" or "changed"
    shards: tuple[str, ...]


def _tensor_digest(label: str, tensor: torch.Tensor) -> tuple[str, str]:
    """The digest of one weight's name, dtype, shape and bytes (the bytes hashed without a
    copy), with the vault's content hash (BLAKE3 where installed)."""
    digest = new_hasher()
    digest.update(f"{label}\0{str(tensor.dtype)}\0{list(tensor.shape)}\0".encode())
    digest.update(tensor_bytes(tensor.detach()))
    return label, digest.hexdigest()


def spill_digest(pending: list[Pending]) -> str:
    """One digest over every pending weight's digest, in name order, as
    ``"<algorithm>:<hex>"`` (the weights hashed on all cores: both hashes release the GIL)."""
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="hostmem-spill-digest") as pool:
        digests = sorted(pool.map(lambda p: _tensor_digest(p.label, p.slot.tensor), pending))
    combined = new_hasher()
    for label, digest in digests:
        combined.update(f"{label}\0{digest}\n".encode())
    return f"{combined.name}:{combined.hexdigest()}"


def _spill_key(vault, pending: list[Pending]):
    """The combination's key: the checkpoint's content and the spilled weights' digest."""
    from .vault import cache_key

    shards = sorted({s for p in pending for s in p.shards})
    dtypes = ",".join(sorted({str(p.slot.tensor.dtype).removeprefix("torch.") for p in pending}))
    policy = f"{SPILL_FORMAT} {spill_digest(pending)}"
    return cache_key(vault.base_identity(shards), [], dtypes, policy)


def _why_not_written(vault, session) -> str:
    """Why a put answered None, in the words of this call."""
    if vault.read_only:
        return (
            f"the cache root {vault.root} is read-only and does not hold these weights; "
            "list a writable root after it (cache_root=[...])"
        )
    return session.last_error or f"the cache in {vault.root} could not take them"


def _serve(session, item: Pending) -> torch.Tensor | None:
    """The weight's mapped layer file: found in the cache, else written now; None if neither."""
    tensor = item.slot.tensor.detach()
    view = session.get(item.label, tuple(tensor.shape), tensor.dtype)
    if view is None:
        view = session.put(item.label, tensor)
    return view


def spill(pending: list[Pending], report, cache_root=None, max_size=None) -> list[Pending]:
    """Write ``pending`` into the vault (or find them there) and map them back read-only.

    Updates ``report`` (spilled count and bytes, layer bytes written and reused, key,
    root, and why some could not be spilled); returns the weights that stay as they were.
    """
    from .vault import Vault, cache_roots, open_in_roots

    if not pending:
        return []
    vaults = [Vault(root, max_size, label=LABEL) for root in cache_roots(cache_root)]
    keyer = next((v for v in vaults if not v.read_only), vaults[0])  # its memo spares the next start a rehash
    key = _spill_key(keyer, pending)
    expected = {p.label: (tuple(p.slot.tensor.shape), p.slot.tensor.dtype) for p in pending}
    vault, session = open_in_roots(vaults, key, expected)
    left = []
    with session:
        for item in pending:
            view = _serve(session, item)
            if view is None:
                left.append(item)
                continue
            report.spilled += 1
            report.spilled_bytes += item.slot.nbytes
            item.slot.replace(view)
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
