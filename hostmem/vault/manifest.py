"""The manifest of one combination: ``<root>/lora_merge_cache/<key>/manifest.json``.

Written last, atomically, when a session closes: it is the seal over the layer files
and the record people read (``hostmem cache ls``). Its format::

    {
      "format": "hostmem-lora-merge-cache",
      "format_version": 2,
      "key": "<sha256 hex>",
      "inputs": {"format_version": 2, "base": {"shards": [...]}, "adapters": [...],
                 "target_dtype": "bfloat16", "merge_policy": "..."},
      "created": 1718000000.0,          # unix seconds
      "last_used": 1718000100.0,        # unix seconds, when it was last sealed
      "complete": true,                 # every layer the builder expected is here
      "total_bytes": 123456,            # sum of the layer files' sizes
      "layers": [{"name": "blocks.0.attn.qkv.weight", "file": "<32 hex>.safetensors",
                  "size": 8192, "header_sha256": "...", "crc32": "<8 hex, of the tensor bytes>",
                  "dtype": "BF16", "shape": [64, 32],
                  "data_offset": 4096,  # where the tensor bytes start
                  "stamp": [dev, ino, size, mtime_ns, ctime_ns]}, ...],  # the file's when they matched crc32
      "layers_sha256": "..."            # of the layers' records (see _layers_digest)
    }

``data_offset`` and ``stamp`` let a start map a layer file that still has that stamp
without reading its header (:mod:`.adoption`). A manifest without them (written by an
older release; both are optional within format 2) is served by reading each layer's
header as it is mapped, as that release did.

A session that only served a sealed combination does not rewrite it; it sets the
manifest file's mtime instead (:func:`touch_use_time`, no fsync: an LRU hint), and the
time a combination was last used is the later of the two (:func:`last_used`).
"""

from __future__ import annotations

import json
import os
import time

from ..errors import HostmemError
from .anchor import in_folder
from .durable import durable_write
from .safety import VaultError, parse_json, read_trusted
from .layer_file import LayerEntry

__all__ = ["MANIFEST_NAME", "MANIFEST_FORMAT", "Manifest", "read_manifest", "write_manifest", "ManifestError",
           "touch_use_time", "last_used", "base_digests", "inputs_problem"]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hostmem-lora-merge-cache"
MANIFEST_VERSION = 2


class ManifestError(HostmemError, ValueError):
    """A manifest that cannot be trusted; its combination is dropped or reported."""


class Manifest:
    """A combination's seal, as :func:`read_manifest` reads it and :func:`write_manifest` writes it.

    A plain class, not a dataclass: every start with the cache imports this module, and
    a dataclass compiles its methods at import (about 1 ms on a small core).
    """

    def __init__(self, key: str, inputs: dict | None = None, created: float | None = None,
                 last_used: float | None = None, complete: bool = False,
                 layers: dict[str, LayerEntry] | None = None):
        now = time.time()
        self.key = key
        self.inputs = inputs if inputs is not None else {}
        self.created = now if created is None else created
        self.last_used = now if last_used is None else last_used
        self.complete = complete
        self.layers = layers if layers is not None else {}

    def __repr__(self) -> str:
        return f"Manifest({self.key[:12]}, {len(self.layers)} layers, complete={self.complete})"

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.layers.values())

    def to_dict(self) -> dict:
        layers = [self.layers[n].to_dict() for n in sorted(self.layers)]
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "key": self.key,
            "inputs": self.inputs,
            "created": self.created,
            "last_used": self.last_used,
            "complete": self.complete,
            "total_bytes": self.total_bytes,
            "layers": layers,
            "layers_sha256": _layers_digest(layers),
        }

    @classmethod
    def from_dict(cls, data: dict, source: str) -> "Manifest":
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{source}: not a manifest of this cache")
        if data.get("format_version") != MANIFEST_VERSION:
            raise ManifestError(f"{source}: manifest format {data.get('format_version')!r}, expected {MANIFEST_VERSION}")
        try:
            layers = [LayerEntry.from_dict(e) for e in data["layers"]]
            if data.get("layers_sha256") != _layers_digest(data["layers"]):
                layers = [e._replace(data_offset=None, stamp=None) for e in layers]  # see _layers_digest
            return cls(
                key=str(data["key"]),
                inputs=dict(data.get("inputs") or {}),
                created=float(data["created"]),
                last_used=float(data["last_used"]),
                complete=bool(data["complete"]),
                layers={e.name: e for e in layers},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"{source}: damaged manifest ({exc!r})") from None


def _layers_digest(layers: list) -> str:
    """sha256 of the layers' records as written. A manifest whose records no longer match it
    (edited by hand, written by an older release) keeps them, but not their offsets and
    stamps: without those, each layer file is vouched for by the verification memo and has
    its header read and checked against its record as it is mapped, as before."""
    import hashlib  # here: `hostmem cache` reads manifests and starts light

    return hashlib.sha256(json.dumps(layers, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def read_manifest(folder: str) -> Manifest | None:
    """Return the folder's manifest, None when there is none yet (a build never sealed).

    Only a regular file of this user's (:func:`~.safety.read_trusted`), and only the
    manifest of the key the folder is named by: a combination moved or renamed onto
    another key's name is another combination's weights (a :class:`ManifestError`)."""
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        data = parse_json(read_trusted(path))
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # not text, not JSON, nested too deeply
        raise ManifestError(f"{path}: not JSON ({exc})") from None
    manifest = Manifest.from_dict(data, path)
    named = os.path.basename(os.path.normpath(folder))
    if manifest.key != named:
        shown = max(12, len(os.path.commonprefix([manifest.key, named])) + 4)  # never two alike figures
        raise ManifestError(f"{path}: the manifest of key {manifest.key[:shown]} in the folder of key "
                            f"{named[:shown]} (moved or renamed); not served, rebuilt by the next start (`hostmem "
                            "cache prune` removes it)")
    return manifest


def write_manifest(folder: str, manifest: Manifest) -> None:
    """Seal: replace the manifest atomically and durably."""
    text = json.dumps(manifest.to_dict(), indent=1, sort_keys=False)
    durable_write(os.path.join(folder, MANIFEST_NAME), text.encode("utf-8"))


def touch_use_time(folder: str) -> None:
    """Record a use of the combination without rewriting its manifest: set the file's mtime
    to now (a hint for the LRU order; where it cannot be set, the use is not recorded)."""
    now = time.time_ns()  # not the filesystem's coarse clock, which may lag the seals' time.time()
    try:  # in its folder's descriptor, walked from the root's: never through a link on the way
        with in_folder(os.path.join(folder, MANIFEST_NAME)) as (folder_fd, name):
            os.utime(name, ns=(now, now), dir_fd=folder_fd, follow_symlinks=False)
    except (OSError, VaultError):
        pass


def last_used(folder: str, manifest: Manifest) -> float:
    """When the combination was last used: its last seal, or a later use that only touched it."""
    try:
        touched = os.lstat(os.path.join(folder, MANIFEST_NAME)).st_mtime
    except OSError:
        touched = 0.0
    return max(manifest.last_used, touched)


def base_digests(inputs: dict) -> list[str] | None:
    """The content digests of the base's shards the inputs record, sorted; None where they
    record none (a base described otherwise, a session opened by a bare key)."""
    base = inputs.get("base") if isinstance(inputs, dict) else None
    shards = base.get("shards") if isinstance(base, dict) else None
    if not isinstance(shards, list) or not shards or not all(isinstance(s, dict) and "digest" in s for s in shards):
        return None
    return sorted(str(s["digest"]) for s in shards)


def inputs_problem(manifest: Manifest, inputs: dict) -> str | None:
    """Why ``manifest`` is not the combination of ``inputs`` (the base's digests differ), or
    None: the key names the bytes, and a manifest says which bytes it was built from."""
    mine, recorded = base_digests(inputs), base_digests(manifest.inputs)
    if mine is None or recorded is None or mine == recorded:
        return None
    return (f"its manifest records a base of digests {', '.join(d[:19] for d in recorded)}, this start's base has "
            f"{', '.join(d[:19] for d in mine)}")
