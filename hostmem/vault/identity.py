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

from ..errors import InputError
from .content_hash import CONTENT_HASH_MEMO, ContentHashMemo

__all__ = [
    "FORMAT_VERSION",
    "CacheKey",
    "cache_key",
    "key_inputs",
    "base_identity",
    "base_identity_of",
    "shard_identity",
    "adapter_identity",
    "provisional_key",
    "same_but_base_digests",
]

FORMAT_VERSION = 4  # 4: input digests name their algorithm (BLAKE3); 3: inputs by whole-content sha256; 2: layer CRC-32
# Fields that say where a file's content came from; its digest stands for them, so the
# same file at another path (or copied, or touched) hits the same cache.
# Recorded for people and for prune, never keyed: where a file is, and an adapter's file
# content digest where its identity's digest is of its meaning (lora_cache.key.canonical_key).
_LOCATION_FIELDS = frozenset({"path", "size", "mtime_ns", "file_digest"})


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
        raise InputError(f"{what} identity {identity!r} has no 'digest'; build it with {build_with}")
    return {k: v for k, v in identity.items() if k not in _LOCATION_FIELDS}


def _key_part_of_base(base: dict) -> dict:
    """The base's shards by content alone, where they carry a digest (from
    :func:`base_identity`); any other base description enters the key as given."""
    shards = base.get("shards") if isinstance(base, dict) else None
    if not shards or not all(isinstance(s, dict) and "digest" in s for s in shards):
        return base
    shards = [_content_part(s, "base shard", "base_identity(paths)") for s in shards]
    return dict(base, shards=sorted(shards, key=lambda s: s["digest"]))


def key_inputs(base: dict, adapters: list[dict], target_dtype, merge_policy: str,
               format_version: int = FORMAT_VERSION) -> dict:
    """The inputs a key is made of, as its manifest records them."""
    return {
        "format_version": int(format_version),
        "base": base,
        "adapters": list(adapters),
        "target_dtype": _dtype_name(target_dtype),
        "merge_policy": str(merge_policy),
    }


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
    inputs = key_inputs(base_identity, adapters, target_dtype, merge_policy, format_version)
    hashed = dict(
        inputs,
        base=_key_part_of_base(base_identity),
        adapters=[_content_part(a, "adapter", "adapter_identity(path, strength, alpha)") for a in adapters],
    )
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"), default=str)
    readable = json.loads(json.dumps(inputs, default=str))  # what the manifest can record
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), readable)


def shard_identity(path: str, stamp: list[int], digest: str) -> dict:
    """Where a file is, for people (from its stamp, :func:`content_hash.stamp_of`), and
    its content digest, for the key."""
    return {"path": path, "size": stamp[2], "mtime_ns": stamp[3], "digest": digest}


def _file_identity(path, memo_file: str | None, memo: ContentHashMemo | None) -> dict:
    resolved = os.path.realpath(os.fspath(path))
    st = os.stat(resolved)
    digest = (memo or CONTENT_HASH_MEMO).digest(resolved, memo_file)
    return {"path": resolved, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest}


def base_identity_of(shards: list[dict]) -> dict:
    """A base's identity from its shards' (:func:`shard_identity`), in digest order, so
    the order the shards were listed in and where they are do not matter."""
    return {"shards": sorted(shards, key=lambda s: (s["digest"], s["path"]))}


def base_identity(shard_paths: list[str], memo_file: str | None = None, memo: ContentHashMemo | None = None) -> dict:
    """Identity of a base checkpoint: per shard its content digest (plus, for people, its
    path, size and mtime), in digest order."""
    if not shard_paths:
        raise InputError("base_identity: no shard paths given (expected the base checkpoint's .safetensors files)")
    return base_identity_of([_file_identity(p, memo_file, memo) for p in shard_paths])


def _all_but_base_digests(inputs: dict) -> dict | None:
    """What a combination's recorded inputs say besides its base's digests: the base by
    its shards' sizes alone; None when the base is not described by shards."""
    base = inputs.get("base") if isinstance(inputs, dict) else None
    shards = base.get("shards") if isinstance(base, dict) else None
    if not shards or not all(isinstance(s, dict) and "size" in s for s in shards):
        return None
    try:
        adapters = [_content_part(a, "adapter", "adapter_identity") for a in inputs.get("adapters", [])]
    except (ValueError, TypeError, AttributeError):
        return None
    rest = {k: v for k, v in inputs.items() if k not in ("base", "adapters")}
    return json.loads(json.dumps(dict(rest, adapters=adapters, base_sizes=sorted(s["size"] for s in shards)),
                                 default=str))


def same_but_base_digests(recorded: dict, inputs: dict) -> bool:
    """Whether a combination recorded with ``recorded`` inputs may be the one ``inputs``
    (whose base shards need not carry digests yet) would key: equal in everything but
    the base's digests, and the base's shards of the same sizes. Then hashing the base
    first may well find it built; otherwise it certainly will not."""
    mine = _all_but_base_digests(inputs)
    return mine is not None and mine == _all_but_base_digests(recorded)


def provisional_key(inputs: dict, stamps: list[list[int]]) -> CacheKey:
    """The key a build opens while its base is still being hashed (see
    :mod:`hostmem.vault.fold`): the other inputs and the base shards' stamps (device,
    inode, size, mtime, ctime, as the digest memo trusts them) under a ``provisional``
    marker, which no real key's inputs carry, so it can never be a real key."""
    marked = dict(inputs, provisional={"stamps": sorted(stamps)})
    canonical = json.dumps(marked, sort_keys=True, separators=(",", ":"), default=str)
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), json.loads(json.dumps(marked, default=str)))


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
