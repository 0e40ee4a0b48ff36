"""The key of a merged combination: what must change when the merged bytes would.

A cached merge is only correct for exactly the inputs it was built from. The key is
a sha256 over a canonical JSON of: the format version, the base checkpoint's
identity (per shard: resolved path, size, mtime_ns, sha256 of its safetensors header
and a sha256 of sampled pages of every tensor), each adapter's content hash with its
strength and alpha override, the target dtype and the merge policy. Hashing a 60 GB
base on every start is out of the question, so a base shard stands for its content
by its header and three pages of every tensor: a replacement with other values under
the same names and size, even with its mtime forged back by ``os.utime``, changes the
key, while a faithful copy (an image layer unpacked on another host) keeps it, so a
cache baked into an image is found there. A same-size replacement of an adapter
changes its content hash.

Hashing a multi-GiB adapter on every start would be slow, so content hashes are
memoised by (path, device, inode, size, mtime_ns, ctime_ns): in this process by a
dict, across processes by an optional JSON file under the cache root. ctime cannot
be set from user space, so even a replacement that restores the old mtime with
``os.utime`` is seen and rehashed.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field

from hostmem.safetensors_map import read_header

from .vault_fs import durable_write

__all__ = [
    "FORMAT_VERSION",
    "CacheKey",
    "cache_key",
    "base_identity",
    "adapter_identity",
    "AdapterHashMemo",
    "ADAPTER_HASH_MEMO",
    "file_sha256",
]

FORMAT_VERSION = 2  # 2: layer files carry a CRC-32 of their data (1: sha256)
# Adapter fields that describe where the content came from; its sha256 stands for them,
# so the same adapter at another path (or copied) hits the same cache.
_ADAPTER_LOCATION_FIELDS = frozenset({"path", "size", "mtime_ns"})
_CHUNK = 8 * 1024 * 1024
_SAMPLE = 4096


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


def _key_part_of_adapter(adapter: dict) -> dict:
    if "sha256" not in adapter:
        raise ValueError(
            f"adapter identity {adapter!r} has no 'sha256'; build it with adapter_identity(path, "
            "strength, alpha_override)"
        )
    return {k: v for k, v in adapter.items() if k not in _ADAPTER_LOCATION_FIELDS}


def cache_key(
    base_identity: dict,
    adapters: list[dict],
    target_dtype: str,
    merge_policy: str,
    format_version: int = FORMAT_VERSION,
) -> CacheKey:
    """Return the key of merging ``adapters`` (in order) into the base.

    Every field of ``base_identity`` enters the key. Of each adapter, every field but
    its location (path, size, mtime_ns) does: its content sha256, strength, alpha
    override, and whatever else the caller adds (key rules, say).
    """
    inputs = {
        "format_version": int(format_version),
        "base": base_identity,
        "adapters": list(adapters),
        "target_dtype": _dtype_name(target_dtype),
        "merge_policy": str(merge_policy),
    }
    hashed = dict(inputs, adapters=[_key_part_of_adapter(a) for a in adapters])
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"), default=str)
    readable = json.loads(json.dumps(inputs, default=str))  # what the manifest can record
    return CacheKey(hashlib.sha256(canonical.encode()).hexdigest(), readable)


def sampled_sha256(path: str, header) -> str:
    """sha256 of three pages of every tensor (its first, middle and last 4 KiB).

    A replacement with other values under the same names changes the pages of every
    tensor it changes, so this sees it; reading it costs three small reads per tensor
    (about 12 KiB, where hashing the whole shard would read gigabytes at every start).
    Unlike an inode or a ctime it survives a copy: a checkpoint and the cache built
    from it can be baked into an image and unpacked on another host.
    """
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        for info in sorted(header.tensors.values(), key=lambda t: t.begin):
            start, end = header.data_offset + info.begin, header.data_offset + info.end
            for offset in sorted({start, (start + end) // 2, max(start, end - _SAMPLE)}):
                digest.update(os.pread(fd, min(_SAMPLE, end - offset), offset))
    finally:
        os.close(fd)
    return digest.hexdigest()


def base_identity(shard_paths: list[str]) -> dict:
    """Identity of a base checkpoint: per shard resolved path, size, mtime_ns, header
    sha256 and a sha256 of sampled pages of every tensor (:func:`sampled_sha256`).

    A shard rewritten with the same names and shapes has the same header, and
    ``os.utime`` can restore its mtime, but the sampled pages of the tensors it changed
    differ. Shards are sorted by resolved path so that the order they were listed in
    does not matter.
    """
    if not shard_paths:
        raise ValueError("base_identity: no shard paths given (expected the base checkpoint's .safetensors files)")
    shards = []
    for path in shard_paths:
        resolved = os.path.realpath(os.fspath(path))
        st = os.stat(resolved)
        header = read_header(resolved)
        shards.append({
            "path": resolved,
            "size": st.st_size,
            "mtime_ns": st.st_mtime_ns,
            "header_sha256": header.header_sha256,
            "sampled_sha256": sampled_sha256(resolved, header),
        })
    shards.sort(key=lambda s: s["path"])
    return {"shards": shards}


def file_sha256(path: str) -> str:
    """sha256 of a whole file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _stamp(st: os.stat_result) -> list[int]:
    """What must be unchanged for a memoised hash to still hold."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class AdapterHashMemo:
    """Content hashes by (path, stamp); optionally persisted to a JSON file.

    ``computed`` and ``hits`` count what happened, so a start can show it did not rehash.
    """

    def __init__(self) -> None:
        self._hashes: dict[str, tuple[list[int], str]] = {}
        self._lock = threading.Lock()
        self.computed = 0
        self.hits = 0

    def sha256(self, path: str, memo_file: str | None = None) -> str:
        """Return the content sha256 of ``path``, from the memo when its stamp matches."""
        st = os.stat(path)
        stamp = _stamp(st)
        with self._lock:
            known = self._hashes.get(path)
            if known is None and memo_file is not None:
                known = _load_memo_file(memo_file).get(path)
            if known is not None and list(known[0]) == stamp:
                self.hits += 1
                self._hashes[path] = (stamp, known[1])
                return known[1]
        digest = file_sha256(path)
        if _stamp(os.stat(path)) != stamp:
            raise ValueError(f"{path}: changed while it was being hashed; start again once it is written")
        with self._lock:
            self.computed += 1
            self._hashes[path] = (stamp, digest)
        if memo_file is not None:
            _store_in_memo_file(memo_file, path, stamp, digest)
        return digest

    def clear(self) -> None:
        with self._lock:
            self._hashes.clear()


ADAPTER_HASH_MEMO = AdapterHashMemo()


def _load_memo_file(memo_file: str) -> dict:
    """Read the on-disk memo; a missing or damaged one is simply empty (it is a hint)."""
    try:
        with open(memo_file, "r", encoding="utf-8") as handle:
            data = json.load(handle)
        return {p: (e["stamp"], e["sha256"]) for p, e in data.get("adapters", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _store_in_memo_file(memo_file: str, path: str, stamp: list[int], digest: str) -> None:
    """Add one hash to the on-disk memo (atomic replace; a lost race only costs a rehash)."""
    entries = {p: {"stamp": s, "sha256": d} for p, (s, d) in _load_memo_file(memo_file).items()}
    entries[path] = {"stamp": stamp, "sha256": digest}
    try:
        durable_write(memo_file, json.dumps({"adapters": entries}, indent=1).encode())
    except OSError:
        pass


def adapter_identity(
    path: str,
    strength: float,
    alpha_override: float | None,
    memo_file: str | None = None,
    memo: AdapterHashMemo | None = None,
) -> dict:
    """Identity of one adapter as applied: content sha256, strength, alpha override.

    ``path``, ``size`` and ``mtime_ns`` are recorded for people (``hostmem cache ls``);
    the key uses the content hash instead. The hash comes from ``memo`` (the process-wide
    one by default) and, with ``memo_file``, from a memo kept on disk across starts.
    """
    resolved = os.path.realpath(os.fspath(path))
    st = os.stat(resolved)
    digest = (memo or ADAPTER_HASH_MEMO).sha256(resolved, memo_file)
    return {
        "path": resolved,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": digest,
        "strength": float(strength),
        "alpha_override": None if alpha_override is None else float(alpha_override),
    }
