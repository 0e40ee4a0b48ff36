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

So the candidates are that folder (or the cached snapshot of that name), then each of its
subfolders. The first whose headers name every copied weight is taken; where several
subfolders do, the one whose tensors hold the copies' values (one row of each, as
:func:`.base_shards.differ_from_files` checks); where that leaves none or several, none.
The files taken are ``base_files`` as a caller gives them: each copy is checked against its
tensor there again before the key names them.
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
    root = name if os.path.isdir(name) else _cached_snapshot(name)
    if root is None:
        return None
    files = _naming_all(root, unplaced)
    if files is not None:
        return files
    named = [f for f in (_naming_all(sub, unplaced) for sub in _subfolders(root)) if f is not None]
    if len(named) > 1:  # the same names in several (Wan 2.2's two experts): the one holding these values
        named = [f for f in named if not differ_from_files(unplaced, space, f)]
    return named[0] if len(named) == 1 else None


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
    try:
        entries = sorted(os.listdir(root))
    except OSError:
        return []
    return [os.path.join(root, e) for e in entries if not e.startswith(".") and os.path.isdir(os.path.join(root, e))]


def _cached_snapshot(name: str) -> str | None:
    """The hub's cached snapshot of ``name`` (its default revision), where ``huggingface_hub``
    is loaded already (the model came through it; importing it costs a start 0.1-0.2 s)."""
    hub = sys.modules.get("huggingface_hub")
    if hub is None or name.count("/") != 1:
        return None
    try:
        folder = hub.snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache, or not a hub name: nothing to find
        return None
    return folder if isinstance(folder, str) and os.path.isdir(folder) else None
