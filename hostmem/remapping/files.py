"""Which safetensors files a loaded model came from, found from the model itself.

A diffusers model records the folder it was loaded from in ``config._name_or_path``
(a pipeline's component records ``<pipeline folder>/<component>``); a transformers
model in ``name_or_path``. In that folder the shards are named by an
``*.safetensors.index.json`` (its ``weight_map``) or are the ``*.safetensors`` files
themselves. A hub id is looked up in the local hub cache only (never downloaded). A
folder that holds no shards but has component subfolders (a model loaded with
``subfolder=``, whose record names only the repository) contributes every
subfolder's shards: remapping compares bytes, so a wrong candidate is never used.
"""

from __future__ import annotations

import glob
import json
import os

from ..errors import HostmemError
from .path_kind import missing_or_not_regular

__all__ = ["CheckpointNotFound", "checkpoint_files", "expand_files", "indexed_shards", "shards_in", "recorded_source"]


class CheckpointNotFound(HostmemError, ValueError):
    """The checkpoint of a model could not be found from what the model records."""


def recorded_source(module) -> str | None:
    """The folder or hub id the model says it was loaded from, or None."""
    config = getattr(module, "config", None)
    for holder, attr in ((config, "_name_or_path"), (module, "name_or_path"), (config, "name_or_path")):
        value = getattr(holder, attr, None) if holder is not None else None
        if value is None and isinstance(holder, dict):
            value = holder.get(attr)
        if isinstance(value, (str, os.PathLike)) and os.fspath(value):
            return os.fspath(value)
    return None


def shards_in(folder: str) -> list[str]:
    """The safetensors shards of ``folder``: those its index files name, else every file."""
    indexes = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors.index.json")))
    if not indexes:
        return sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    return indexed_shards(folder, indexes)


def indexed_shards(folder: str, indexes: list[str]) -> list[str]:
    """The shards the index files ``indexes`` (paths in ``folder``) name in their
    ``weight_map``, each one there."""
    shards = set()
    for index in indexes:
        try:
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
            shards.update(os.path.join(folder, name) for name in weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointNotFound(f"{index}: not a safetensors index with a weight_map ({exc})") from None
    missing = [s for s in sorted(shards) if not os.path.isfile(s)]
    if missing:
        raise CheckpointNotFound(f"{indexes[0]} names shards that are not there: {', '.join(missing[:3])}; "
                                 "write them, or fix the index")
    return sorted(shards)


def _local_hub_folder(repo_id: str) -> str | None:
    """The local hub-cache snapshot of ``repo_id`` (no download), or None."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, not a repo id: the caller says what to pass instead
        return None


def _folder_shards(folder: str) -> list[str]:
    shards = shards_in(folder)
    if shards:
        return shards
    for sub in sorted(os.scandir(folder), key=lambda e: e.name):
        if sub.is_dir():
            shards += shards_in(sub.path)
    return shards


def checkpoint_files(module, component: str = "") -> list[str]:
    """The shards ``module`` was loaded from, found from its own config (see the module doc)."""
    source = recorded_source(module)
    label = f"component {component!r}" if component else type(module).__name__
    if source is None:
        raise CheckpointNotFound(
            f"{label} does not record where it was loaded from (no config._name_or_path): pass files=[its .safetensors shards]"
        )
    folder = source if os.path.isdir(source) else _local_hub_folder(source)
    if folder is None:
        raise CheckpointNotFound(
            f"{label} was loaded from {source!r}, which is neither a folder nor in the local hub cache: "
            "pass files=[its .safetensors shards]"
        )
    if component and os.path.isdir(os.path.join(folder, component)) and not shards_in(folder):
        folder = os.path.join(folder, component)
    shards = _folder_shards(folder)
    if not shards:
        raise CheckpointNotFound(f"{label}: no .safetensors checkpoint in {folder}: pass files=[its shards]")
    return shards


def expand_files(files) -> list[str]:
    """``files`` as given (a shard, a folder, or a list of them) as a list of shard paths."""
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    out: list[str] = []
    for entry in files:
        path = os.path.expanduser(os.fspath(entry))
        if os.path.isdir(path):
            found = _folder_shards(path)
            if not found:
                raise CheckpointNotFound(f"{path}: no .safetensors checkpoint in this folder")
            out += found
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise CheckpointNotFound(f"{path}: {missing_or_not_regular(path)}")
    return out
