"""Adoption: what a session may trust of a combination folder when it opens it.

Runs under the key's lock, so nobody writes meanwhile. Temporary files are leftovers
of a writer that died and go. Layers the manifest records must still have the size
and header it recorded; layer files it does not record (a build that was killed, or
a session that added layers and died before sealing) are adopted on their own
header, which carries their checksum. Anything that does not match what was
recorded or what the caller expects drops the whole combination: a partial trust
in a combination that changed under us is how a stale layer gets served.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hostmem.safetensors_map import DTYPES, SafetensorsError

from .vault_fs import TMP_PREFIX, discard, fsync_dir, make_private_dir, remove_tree
from .vault_layer import LayerEntry, is_layer_file_name, layer_problem, read_layer_file
from .vault_manifest import Manifest, ManifestError, read_manifest

__all__ = ["Adopted", "adopt", "drop_folder", "shape_dtype_problem"]


@dataclass
class Adopted:
    """What a folder held that can be served, and why it was dropped, if it was."""

    entries: dict[str, LayerEntry]
    manifest: Manifest | None
    dropped: str | None = None
    resumed: int = 0  # layer files found without a manifest entry (an interrupted build)


def shape_dtype_problem(entry: LayerEntry, shape, dtype: torch.dtype) -> str | None:
    """Why ``entry`` is not the layer asked for (shape or dtype), or None."""
    if tuple(shape) != entry.shape or DTYPES[entry.dtype] != dtype:
        return (
            f"layer {entry.name!r} is cached as {list(entry.shape)} {DTYPES[entry.dtype]}, "
            f"but {list(shape)} {dtype} was asked for"
        )
    return None


def drop_folder(folder: str) -> None:
    """Empty a combination folder (it is about to be rebuilt); links are unlinked, not followed."""
    remove_tree(folder)
    make_private_dir(folder)
    fsync_dir(os.path.dirname(folder))


def _remove_leftovers(folder: str) -> None:
    for name in os.listdir(folder):
        if name.startswith(TMP_PREFIX):
            discard(os.path.join(folder, name))


def _recorded(folder: str, manifest: Manifest) -> tuple[dict[str, LayerEntry], str | None]:
    entries = {}
    for entry in manifest.layers.values():
        problem = layer_problem(folder, entry)
        if problem:
            return {}, problem
        entries[entry.name] = entry
    return entries, None


def _unrecorded(folder: str, known_files: set[str]) -> dict[str, LayerEntry]:
    """Sealed layer files the manifest does not list (a build that did not get to seal)."""
    found = {}
    for name in sorted(os.listdir(folder)):
        if not is_layer_file_name(name) or name in known_files:
            continue
        path = os.path.join(folder, name)
        try:
            entry = read_layer_file(path)
        except (SafetensorsError, OSError):
            discard(path)  # never recorded, never valid: nothing to serve
            continue
        found[entry.name] = entry
    return found


def _expected_problem(entries: dict[str, LayerEntry], expected: dict | None) -> str | None:
    for name, (shape, dtype) in (expected or {}).items():
        entry = entries.get(name)
        problem = entry and shape_dtype_problem(entry, shape, dtype)
        if problem:
            return problem
    return None


def adopt(folder: str, expected: dict | None) -> Adopted:
    """Read what ``folder`` holds that can be served; drop the folder when it mismatches."""
    _remove_leftovers(folder)
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        drop_folder(folder)
        return Adopted({}, None, dropped=str(exc))
    entries, problem = _recorded(folder, manifest) if manifest else ({}, None)
    if problem is None:
        extra = _unrecorded(folder, {e.file for e in entries.values()})
        entries.update(extra)
        problem = _expected_problem(entries, expected)
    if problem:
        drop_folder(folder)
        return Adopted({}, None, dropped=problem)
    return Adopted(entries, manifest, resumed=len(extra))
