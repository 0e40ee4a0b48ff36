"""The checkpoint files a model was loaded from, where some of its weights are copies.

diffusers keeps a Wan transformer's ``time_embedder``, norms and ``scale_shift_table`` in
fp32 under any ``torch_dtype`` (copies, no views of the file), and a LoRA touching them
(lightx2v's, ComfyUI's diffs) needs the files those copies came from to be keyed. The
model records where it was loaded from (``config._name_or_path``), though not always the
folder itself:

- ``from_pretrained(folder)`` and a pipeline's components record the folder of the
  weights;
- ``from_pretrained(root, subfolder="transformer")`` records the root, whose subfolders
  hold the weights (and, in Wan 2.2's repository, a second expert of the same names and
  shapes beside the first);
- ``from_pretrained("org/name", ...)`` records the hub's name; the files are in the hub's
  local cache, which ``huggingface_hub`` (loaded by the client that loaded the model)
  finds without the network.

So the candidates are that folder's files (or a cached snapshot's of that name: the
default revision's first, then the others, since ``revision=`` is not recorded) and each
subfolder's that ``from_pretrained(..., subfolder=)`` could load (it holds a
``config.json``), those that name every copied weight in their headers. One is taken;
of several, the one whose tensors hold the copies' values (one row of each, as
:func:`.base_shards.differ_from_files` checks), or, where none does, the first (the start
then merges in place with a warning, as with a folder of other values). Where several hold
them (two experts alike in every row checked), none: keyed by the wrong one, the other's
next start would be served this one's merge. The files taken are ``base_files`` as a
caller gives them: each copy is checked against its tensor there again before the key
names them.
"""

from __future__ import annotations

import os
import sys

from ..targets.layer_target import AddressSpace, LayerTarget
from .base_shards import differ_from_files, header_matches, mapped_file

__all__ = ["loaded_from"]


def loaded_from(model, targets: list[LayerTarget]) -> list[str] | None:
    """The ``.safetensors`` files ``model`` was loaded from, where some of ``targets`` are no
    views of a mapped file and the model names where it came from (see the module doc), as
    that loader picks them (:func:`hostmem.remapping.folder.checkpoint_files`); else None."""
    space = AddressSpace()
    unplaced = [t for t in targets if mapped_file(t, space) is None]
    if not unplaced:
        return None
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        return None
    name = os.fspath(name)  # from_pretrained(Path(...)) records the Path
    roots = [name] if os.path.isdir(name) else _cached_snapshots(name)
    fallback = None
    for root in roots:
        candidates = _candidates(root, unplaced)
        if len(candidates) == 1 and len(roots) == 1:
            return candidates[0]  # checked against the copies when keyed (the start warns if they differ)
        holding = [f for f in candidates if not differ_from_files(unplaced, space, f)]
        if holding:
            return holding[0] if len(holding) == 1 else None
        fallback = fallback or (candidates[0] if candidates else None)
    return fallback  # none holds these values: the start merges in place, saying so


def _candidates(root: str, unplaced: list[LayerTarget]) -> list[list[str]]:
    """The checkpoint files of ``root`` and of each subfolder that name every weight, one entry
    per set of files (a folder linked twice is one)."""
    named: dict[tuple, list[str]] = {}
    for folder in (root, *_subfolders(root)):
        files = _naming_all(folder, unplaced)
        if files is not None:
            named.setdefault(tuple(files), files)
    return list(named.values())


def _naming_all(folder: str, unplaced: list[LayerTarget]) -> list[str] | None:
    """The checkpoint files of ``folder`` where one tensor of them is named for each weight."""
    from hostmem.remapping.folder import checkpoint_files
    from hostmem.safetensors.header import SafetensorsError

    try:
        files = [os.path.realpath(p) for p in checkpoint_files(folder)]
        found = header_matches(unplaced, files)
    except (SafetensorsError, OSError, ValueError):
        return None
    # each weight must be one tensor of them: a folder of other weights (a repository's root
    # beside the subfolder a model came from) names none, and says nothing of their bytes
    return files if all(t.name in found for t in unplaced) else None


def _subfolders(root: str) -> list[str]:
    """The subfolders ``from_pretrained(root, subfolder=...)`` could load: each holds a ``config.json``
    (a folder of LoRAs or other files beside them is never read)."""
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, e) for e in entries
            if not e.startswith(".") and os.path.isfile(os.path.join(root, e, "config.json"))]


def _cached_snapshots(name: str) -> list[str]:
    """The hub's cached snapshots of ``name``, its default revision's (``refs/main``) first,
    where ``huggingface_hub`` is loaded already (the model came through it), laid out as the
    hub lays its cache out: ``models--org--name/refs/main`` names ``snapshots/<commit>``.
    ``_name_or_path`` does not record a ``revision=``: the others follow, newest first.

    Read from the folders, not through ``snapshot_download(local_files_only=True)``, which
    refuses a snapshot that lacks a file of the repository's listing (every download of a
    part of a repository leaves one)."""
    hub = sys.modules.get("huggingface_hub")
    cache = getattr(getattr(hub, "constants", None), "HF_HUB_CACHE", None)
    if not isinstance(cache, str) or name.count("/") != 1 or not all(name.split("/")):
        return []
    repo = os.path.join(cache, "models--" + name.replace("/", "--"))
    snapshots = os.path.join(repo, "snapshots")
    try:
        with os.scandir(snapshots) as entries:
            found = sorted(((e.stat().st_mtime, e.path) for e in entries if e.is_dir()), reverse=True)
    except OSError:
        return []
    try:
        with open(os.path.join(repo, "refs", "main"), encoding="ascii") as handle:
            main = os.path.join(snapshots, handle.read().strip())
    except (OSError, ValueError):
        main = None
    folders = [path for _, path in found]
    return sorted(folders, key=lambda path: path != main)  # stable: main first, the rest newest first
