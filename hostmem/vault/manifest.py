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
                  "dtype": "BF16", "shape": [64, 32]}, ...]
    }

A session that only served a sealed combination does not rewrite it; it sets the
manifest file's mtime instead (:func:`touch_use_time`, no fsync: an LRU hint), and the
time a combination was last used is the later of the two (:func:`last_used`).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

from .durable import durable_write
from .safety import check_not_symlink
from .layer_file import LayerEntry

__all__ = ["MANIFEST_NAME", "MANIFEST_FORMAT", "Manifest", "read_manifest", "write_manifest", "ManifestError",
           "touch_use_time", "last_used"]

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hostmem-lora-merge-cache"
MANIFEST_VERSION = 2


class ManifestError(ValueError):
    """A manifest that cannot be trusted; its combination is dropped or reported."""


@dataclass
class Manifest:
    key: str
    inputs: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    complete: bool = False
    layers: dict[str, LayerEntry] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.layers.values())

    def to_dict(self) -> dict:
        return {
            "format": MANIFEST_FORMAT,
            "format_version": MANIFEST_VERSION,
            "key": self.key,
            "inputs": self.inputs,
            "created": self.created,
            "last_used": self.last_used,
            "complete": self.complete,
            "total_bytes": self.total_bytes,
            "layers": [self.layers[n].to_dict() for n in sorted(self.layers)],
        }

    @classmethod
    def from_dict(cls, data: dict, source: str) -> "Manifest":
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ManifestError(f"{source}: not a manifest of this cache")
        if data.get("format_version") != MANIFEST_VERSION:
            raise ManifestError(f"{source}: manifest format {data.get('format_version')!r}, expected {MANIFEST_VERSION}")
        try:
            layers = [LayerEntry.from_dict(e) for e in data["layers"]]
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


def read_manifest(folder: str) -> Manifest | None:
    """Return the folder's manifest, None when there is none yet (a build never sealed)."""
    path = os.path.join(folder, MANIFEST_NAME)
    try:
        check_not_symlink(path)
        with open(path, "rb") as handle:
            data = json.loads(handle.read())
    except FileNotFoundError:
        return None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: not JSON ({exc})") from None
    return Manifest.from_dict(data, path)


def write_manifest(folder: str, manifest: Manifest) -> None:
    """Seal: replace the manifest atomically and durably."""
    text = json.dumps(manifest.to_dict(), indent=1, sort_keys=False)
    durable_write(os.path.join(folder, MANIFEST_NAME), text.encode("utf-8"))


def touch_use_time(folder: str) -> None:
    """Record a use of the combination without rewriting its manifest: set the file's mtime
    to now (a hint for the LRU order; where it cannot be set, the use is not recorded)."""
    now = time.time_ns()  # not the filesystem's coarse clock, which may lag the seals' time.time()
    try:
        os.utime(os.path.join(folder, MANIFEST_NAME), ns=(now, now), follow_symlinks=False)
    except OSError:
        pass


def last_used(folder: str, manifest: Manifest) -> float:
    """When the combination was last used: its last seal, or a later use that only touched it."""
    try:
        touched = os.lstat(os.path.join(folder, MANIFEST_NAME)).st_mtime
    except OSError:
        touched = 0.0
    return max(manifest.last_used, touched)
