"""The targets of adapters only diffusers' converters map, for a plan made before loading.

Some files name a diffusers model's weights only through diffusers' converters (the
original checkpoint's names of Wan, MiniMax-H3 or XLabs Flux): the headers alone cannot
place them, and this package's own reader refuses them, yet a merge into the diffusers
model reads them with the model class's converter (:mod:`lora_cache.adapters.for_model`).
A plan of such a model (its folder's ``config.json`` names the class:
:func:`planners.checkpoint.diffusers_class`) reads them the same two ways the merge can:

- from a conversion record (:mod:`lora_cache.adapters.conversion_memo`) a merge left
  under one of the cache roots, found by the file's content digest and the installed
  diffusers' version: the record's names and shapes go through the header reading
  (:func:`lora_cache.targets.header_targets.tensor_targets`), and neither torch nor diffusers is
  imported. The record is read as every record is (:class:`hostmem.vault.shelf.Shelf`:
  a folder and file of ours, never a link); one this reading cannot take is no record.
- else by converting the file with diffusers, as the merge would (torch imported), and
  planning the converted keys with the merge's own planner.

A plan never writes a record: the cache roots are the merge's.
"""

from __future__ import annotations

import os
from collections import namedtuple

from hostmem.vault.combinations import CACHE_DIR
from hostmem.vault.content_hash import CONTENT_HASH_MEMO, MEMO_NAME, file_digest
from hostmem.vault.records import CONVERSIONS
from hostmem.vault.shelf import Shelf

from ..adapters.paths import adapter_file_in
from .header_targets import NeedsReader, adapter_path_rules, header_targets, listed_adapters, tensor_targets

__all__ = ["loader_for", "recorded_targets"]

# What lora_cache.adapters.conversion_memo writes (tests/lora_cache/test_planned_conversion.py
# holds the two together; that module imports torch, so the names are not imported from it).
RECORD_FORMAT = "lora-cache-adapter-conversion"
RECORD_VERSION = 4
_DTYPES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32", "float64": "F64"}  # torch's names -> the header's

_Tensor = namedtuple("_Tensor", "shape dtype")
_Root = namedtuple("_Root", "cache read_only")  # what Shelf reads of a root; a plan only reads


def loader_for(class_name: str):
    """The loader mixin whose converter a merge into a ``class_name`` model uses, or None
    (diffusers missing, or it loads no LoRA into that class). Imports diffusers."""
    try:
        from ..adapters.diffusers_format import diffusers_loader
    except ImportError:
        return None
    try:
        return diffusers_loader(type(class_name, (), {})())  # it goes by the class's name alone
    except ImportError:
        return None


def recorded_targets(adapters, shapes: dict[str, tuple[int, ...]], roots) -> tuple[tuple[str, ...], str] | None:
    """``(names, where)``: the parameters the adapters change, each file read from its header
    or, where that cannot place it, from its conversion record under ``roots``; None where a
    file has neither (the caller converts). Imports neither torch nor diffusers."""
    version = _diffusers_version()
    if version is None or not roots:
        return None
    changed, used = set(), []
    for adapter in listed_adapters(adapters):
        try:
            changed.update(header_targets([adapter], shapes))
            continue
        except NeedsReader:
            pass
        path, rules = adapter_path_rules(adapter)
        found = _record_of(path, roots, version)
        if found is None or (found[0]["left"]["dropped"] and _strict(adapter)):
            return None  # a strict merge refuses dropped keys: the converter says so
        tensors = {key: _Tensor(tuple(i["shape"]), _DTYPES.get(i["dtype"], i["dtype"]))
                   for key, i in found[0]["tensors"].items()}
        try:
            changed.update(tensor_targets(path, tensors, rules, shapes))
        except NeedsReader:
            return None
        used.append(found[1])
    return tuple(name for name in shapes if name in changed), ", ".join(dict.fromkeys(used))


def _strict(adapter) -> bool:
    return not isinstance(adapter, dict) or adapter.get("strict", True) is not False


def _diffusers_version() -> str | None:
    """The installed diffusers' version (from its metadata, not an import), or None."""
    from importlib import metadata

    try:
        return metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        return None


def _record_of(given: str, roots, version: str) -> tuple[dict, str] | None:
    """``(record, root)``: a conversion of this file's content by this diffusers, from the
    first root that holds one, else None."""
    path, _ = adapter_file_in(given)
    if path is None or not os.path.isfile(path):
        return None
    listed = []
    for root in roots:
        cache = os.path.join(root, CACHE_DIR)
        try:
            names = sorted(n[:-5] for n in os.listdir(os.path.join(cache, CONVERSIONS)) if n.endswith(".json"))
        except OSError:
            continue
        listed.append((root, Shelf([_Root(cache, True)], CONVERSIONS), names))
    if not listed:
        return None  # no record anywhere: the file is not hashed
    digest = _digest(os.path.realpath(path), roots)
    for root, shelf, names in listed:
        for name in names:
            record = shelf.load(name, lambda r: _usable(r, digest, version))
            if record is not None:
                return record, root
    return None


def _digest(path: str, roots) -> str:
    """The file's content digest: memoised under a root while the file is unchanged, else hashed."""
    for root in roots:
        _, known = CONTENT_HASH_MEMO.known(path, os.path.join(root, CACHE_DIR, MEMO_NAME))
        if known is not None:
            return known
    return file_digest(path)


def _usable(record, digest: str, version: str) -> bool:
    """A whole diffusers conversion record of this content by this diffusers' version."""
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT or record.get("version") != RECORD_VERSION:
        return False
    if record.get("kind") != "diffusers" or record.get("digest") != digest:
        return False
    if not str(record.get("converter", "")).startswith(f"diffusers {version} "):
        return False
    left, tensors = record.get("left"), record.get("tensors")
    if not isinstance(left, dict) or not isinstance(left.get("dropped"), list):
        return False
    return isinstance(tensors, dict) and bool(tensors) and all(
        isinstance(i, dict) and isinstance(i.get("dtype"), str) and isinstance(i.get("shape"), list)
        and all(isinstance(n, int) and n >= 0 for n in i["shape"]) for i in tensors.values())
