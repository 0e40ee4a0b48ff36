"""What a conversion of an adapter file produced, kept by the file's content, so that a
start whose every merged layer is cached plans its merge without converting.

diffusers' converters (the pipeline class's ``lora_state_dict``) copy and rescale every
tensor of the file: converting is as much anonymous memory as the adapter, and it reads
every value. A start whose combination is complete in the cache needs none of that: the
layers to merge, the key and the kernels depend only on the names, shapes and dtypes the
conversion produced and on its alphas. So each conversion is recorded under
``<root>/lora_merge_cache/conversions/<key>.json``, keyed by the file's content digest (the
one the cache key uses, memoised across starts), the converter (diffusers' version and
loader class) and the components kept. A record names that digest, so ``hostmem cache
prune`` removes it once no combination left uses the file (:mod:`hostmem.vault.records`).
A later start reads the record and plans with tensors on the meta device: no value of
the adapter is read or copied. When a layer must then be computed (a miss, a layer
merged in place), the first use of the values raises :class:`ValuesNeeded` before any
weight changes, and the merge converts the file for real and plans again (:func:`lora_cache.orchestrate.merge`).

A record that cannot be read (missing, damaged, another version) is no record: the file
is converted, and the record written again. Records are written like the cache's other
memos (atomically, into the first writable root); a read-only root's records are read.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch

from hostmem.errors import HostmemError
from hostmem.vault.records import CONVERSIONS
from hostmem.vault.shelf import Shelf
from .read_stamps import read_as

__all__ = ["ConversionMemo", "ValuesNeeded", "NoValues", "record_of", "skeleton_of"]

RECORD_FORMAT = "lora-cache-adapter-conversion"
# 2: the alphas folded, and the override; 3: "family-rules" (a file of original names);
# 4: a diff_b the converter made peft's lora_B.bias is a diff_b again
RECORD_VERSION = 4
FOLDER = CONVERSIONS  # a folder hostmem cache prune looks after (hostmem.vault.records)


class ValuesNeeded(HostmemError):
    """A merge planned from a conversion record must compute a layer: convert, plan again.

    Caught inside the merge (which converts and plans again); a project error like every
    other, so a caller that catches ``HostmemError`` never meets a stray one."""


class NoValues:
    """The values check of an adapter planned from its record: it holds no values, so the
    first use of them raises :class:`ValuesNeeded` (before any weight changes)."""

    def __init__(self, path: str):
        self.path = path
        self.read_as = read_as(path)  # the file as the read planned from the record found it

    def __call__(self) -> None:
        raise ValuesNeeded(f"{self.path}: planned from its conversion record; a layer needs its values")


def record_of(kind: str, converter: str, tensors: dict[str, torch.Tensor] | None = None,
              folded: bool = False, left: dict[str, list[str]] | None = None) -> dict:
    """The record of one conversion: ``kind`` (``"diffusers"``: its tensors by name, shape
    and dtype, alphas with their values; ``"family-rules"``: read by this package's reader
    with the family's original names, :mod:`lora_cache.adapters.family_rules`),
    the converter that the cache key names, whether it folded the alphas, and the keys it
    left unused (``dropped`` by it, ``others``: another component's), named again (or
    refused) on every start planned from it."""
    record = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "kind": kind, "converter": converter,
              "folded": bool(folded), "left": {"dropped": [], "others": [], **(left or {})}}
    if tensors is not None:
        record["tensors"] = {key: _describe(key, t) for key, t in sorted(tensors.items())}
    return record


def _describe(key: str, tensor: torch.Tensor) -> dict:
    """A converted tensor as the record keeps it: shape and dtype, and an alpha's value."""
    info = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch.")}
    if key.endswith(".alpha"):  # one number each (checked): the scale needs it, even on a hit
        info["value"] = tensor.double().reshape(-1).tolist()
    return info


def skeleton_of(record: dict) -> dict[str, torch.Tensor]:
    """The record's tensors: alphas with their values, every other one on the meta device
    (its name, shape and dtype only: planning reads nothing else)."""
    tensors = {}
    for key, info in record["tensors"].items():
        dtype = getattr(torch, info["dtype"])
        if "value" in info:
            tensors[key] = torch.tensor(info["value"], dtype=torch.float64).to(dtype).reshape(info["shape"])
        else:
            tensors[key] = torch.empty(info["shape"], dtype=dtype, device="meta")
    return tensors


def _valid(record) -> bool:
    """Whether ``record`` is one this version wrote whole (anything else is no record)."""
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        return False
    if record.get("version") != RECORD_VERSION or not isinstance(record.get("converter"), str):
        return False
    if not isinstance(record.get("folded"), bool) or not _valid_left(record.get("left")):
        return False
    if record.get("kind") in ("family-rules", "kohya-flux"):
        return True
    tensors = record.get("tensors")
    if record.get("kind") != "diffusers" or not isinstance(tensors, dict) or not tensors:
        return False
    return all(_valid_tensor(info) for info in tensors.values())


def _valid_left(left) -> bool:
    """The keys left unused: a list of names for each of ``dropped`` and ``others``."""
    return isinstance(left, dict) and set(left) == {"dropped", "others"} and all(
        isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in left.values())


def _valid_tensor(info) -> bool:
    """A tensor's entry: a dtype torch knows, a shape of sizes, an alpha's values that fill it."""
    if not isinstance(info, dict) or not isinstance(getattr(torch, str(info.get("dtype")), None), torch.dtype):
        return False
    shape, values = info.get("shape"), info.get("value", [])
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        return False
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
        return False
    return "value" not in info or len(values) == math.prod(shape)


class ConversionMemo:
    """The conversion records of the cache roots one merge uses (see the module docstring)."""

    def __init__(self, roots: list[str]):
        from hostmem.vault import Vault

        self.vaults = [Vault(root) for root in roots]
        self._shelf = Shelf(self.vaults, FOLDER)
        self.writable = self._shelf.writable
        self._digests: dict[str, str] = {}  # record name -> the digest of the file it describes

    def key(self, path: str, converter: str, components: tuple[str, ...], alpha: float | None = None) -> str:
        """The record's name: the file's content digest (memoised under the root the cache
        key's digests are), the converter, the components kept and the alpha override
        (which the converter may fold in place of the file's)."""
        keyer = self.writable or self.vaults[0]
        digest = keyer.adapter_identity(path, 1.0, None)["digest"]
        inputs = {"version": RECORD_VERSION, "digest": digest, "converter": converter, "components": list(components),
                  "alpha": None if alpha is None else float(alpha)}
        name = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
        self._digests[name] = digest
        return name

    def load(self, key: str) -> dict | None:
        """The record named ``key`` from the first root that holds a readable one, else None."""
        return self._shelf.load(key, _valid)

    def store(self, key: str, record: dict) -> None:
        """Write ``record`` into the first writable root (a hint: where it cannot be
        written, the next start converts again)."""
        self._shelf.store(key, {**record, "digest": self._digests[key]} if key in self._digests else record)
