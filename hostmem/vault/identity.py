"""The key of a merged combination: what must change when the merged bytes would.

A cached merge is only correct for exactly the inputs it was built from. The key is
a sha256 over a canonical JSON of: the format version, each base shard's content
digest (``blake3:<hex>``: it names its algorithm; the shards that hold the merged
weights, in digest order), each adapter's content digest with its strength and alpha override and whatever the caller adds, the
target dtype and the merge policy. Digests cover every byte of a file
(:mod:`hostmem.vault.content_hash`), so any change anywhere changes the key,
whatever the timestamps say, while a touched, copied, moved or freshly unpacked file
keeps it (a cache baked into an image is found on another host). Paths, sizes and
mtimes are recorded for people (``hostmem cache ls``) but stay out of the key.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from .content_hash import CONTENT_HASH_MEMO, ContentHashMemo

__all__ = [
    "FORMAT_VERSION",
    "CacheKey",
    "cache_key",
    "base_identity",
    "adapter_identity",
]

FORMAT_VERSION = 4  # 4: input digests name their algorithm (BLAKE3); 3: inputs by whole-content sha256; 2: layer CRC-32
# Fields that say where a file's content came from; its digest stands for them, so the
# same file at another path (or copied, or touched) hits the same cache.
_LOCATION_FIELDS = frozenset({"path", "size", "mtime_ns"})


@dataclass(frozen=True)
class CacheKey:
    """A combination's key: ``hex`` (sha256) plus the inputs, for people to read."""

    hex: str
    inputs: dict = field(compare=False, hash=False, repr=False)

    @property
    def short(self) -> str:
        return self.hex[:12]

    def __str__(self) -> str:
        return self.hex


def _dtype_name(target_dtype) -> str:
    """``torch.bfloat16``, ``"torch.bfloat16"`` and ``"bfloat16"`` name the same dtype."""
    name = str(target_dtype)
    return name[len("torch."):] if name.startswith("torch.") else name


def _content_part(identity: dict, what: str, build_with: str) -> dict:
    if "digest" not in identity:
        raise ValueError(f"{what} identity {identity!r} has no 'digest'; build it with {build_with}")
    return {k: v for k, v in identity.items() if k not in _LOCATION_FIELDS}


def _key_part_of_base(base: dict) -> dict:
    """The base's shards by content alone, where they carry a digest (from
    :func:`base_identity`); any other base description enters the key as given."""
    shards = base.get("shards") if isinstance(base, dict) else None
    if not shards or not all(isinstance(s, dict) and "digest" in s for s in shards):
        return base
    shards = [_content_part(s, "base shard", "base_identity(paths)") for s in shards]
    return dict(base, shards=sorted(shards, key=lambda s: s["digest"]))


def cache_key(
    base_identity: dict,
    adapters: list[dict],
    target_dtype: str,
    merge_policy: str,
    format_version: int = FORMAT_VERSION,
) -> CacheKey:
    """Return the key of merging ``adapters`` (in order) into the base.

    Of each base shard and each adapter, every field but its location (path, size,
    mtime_ns) enters the key: its content digest, and for adapters the strength, alpha
    override and whatever else the caller adds (key rules, say).
    """
    inputs = {
        "format_version": int(format_version),
        "base": base_identity,
        "adapters": list(adapters),
        "target_dtype": _dtype_name(target_dtype),
        "merge_policy": str(merge_policy),
    }
    hashed = dict(
        inputs,
        base=_key_part_of_base(base_identity),
        adapters=[_content_part(a, "adapter", "adapter_identity(path, strength, alpha)") for a in adapters],
    )
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"), default=str)
    readable = json.loads(json.dumps(inputs, default=str))  # what the manifest can record
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), readable)


def _file_identity(path, memo_file: str | None, memo: ContentHashMemo | None) -> dict:
    """Where a file is, for people, and its content digest, for the key."""
    resolved = os.path.realpath(os.fspath(path))
    st = os.stat(resolved)
    digest = (memo or CONTENT_HASH_MEMO).digest(resolved, memo_file)
    return {"path": resolved, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest}


def base_identity(shard_paths: list[str], memo_file: str | None = None, memo: ContentHashMemo | None = None) -> dict:
    """Identity of a base checkpoint: per shard its content digest (plus, for people, its
    path, size and mtime), in digest order, so the order the shards were listed in and
    where they are do not matter."""
    if not shard_paths:
        raise ValueError("base_identity: no shard paths given (expected the base checkpoint's .safetensors files)")
    shards = [_file_identity(p, memo_file, memo) for p in shard_paths]
    return {"shards": sorted(shards, key=lambda s: (s["digest"], s["path"]))}


def adapter_identity(
    path: str,
    strength: float,
    alpha_override: float | None,
    memo_file: str | None = None,
    memo: ContentHashMemo | None = None,
) -> dict:
    """Identity of one adapter as applied: content digest, strength, alpha override.

    ``path``, ``size`` and ``mtime_ns`` are recorded for people (``hostmem cache ls``);
    the key uses the content digest instead. The digest comes from ``memo`` (the
    process-wide one by default) and, with ``memo_file``, from a memo kept on disk.
    """
    return {
        **_file_identity(path, memo_file, memo),
        "strength": float(strength),
        "alpha_override": None if alpha_override is None else float(alpha_override),
    }
