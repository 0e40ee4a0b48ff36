"""Which ``.safetensors`` files of a folder its ``from_pretrained`` loads.

A checkpoint folder holds more than the weights a loader reads: a LoRA saved beside the
model, the weights in another variant (``fp16``), an index and its shards. The plan
sizes, and the cache keys, exactly the files the loader would read.
"""

from __future__ import annotations

import os
import re

from ..safetensors.header import SafetensorsError
from .path_kind import missing_or_not_regular

__all__ = ["checkpoint_files"]


# diffusers' and transformers' weight files: ``NAME[.VARIANT][-00001-of-00003].safetensors``, or
# the older sharded variant ``NAME-00001-of-00003.VARIANT.safetensors``
_WEIGHTS = re.compile(
    r"^(?:diffusion_pytorch_model|model)(?:\.(?P<variant>[A-Za-z0-9_]+))?(?:-\d+-of-\d+)?"
    r"(?:\.(?P<legacy>[A-Za-z0-9_]+))?\.safetensors$"
)


def _variant(name: str) -> str | None:
    """The variant a weight file's name carries (``fp16`` of ``model.fp16.safetensors``), ``""``
    for a plain weights file of those names, None for any other name."""
    match = _WEIGHTS.match(name)
    return None if match is None else (match["variant"] or match["legacy"] or "")


# (weights name, whether its index comes before its single file): diffusers loads the shards an
# index names where there is one; transformers loads model.safetensors where there is one
_LOADERS = (("diffusion_pytorch_model", True), ("model", False))


def checkpoint_files(path: str, variant: str | None = None) -> list[str]:
    """The ``.safetensors`` files of ``path``: a file, or the files of a folder that
    diffusers' (or transformers') ``from_pretrained`` loads.

    In a folder, as that loader picks them: diffusers' shards its index names
    (``diffusion_pytorch_model.safetensors.index.json``, with ``variant``
    ``….index.VARIANT.json``), else its single file
    (``diffusion_pytorch_model[.VARIANT].safetensors``); transformers' ``model.safetensors``,
    else its index's shards. Without either, the weights files by their names (sharded or
    not; the plain ones, or with ``variant`` (``"fp16"``) that variant's), any other
    ``.safetensors`` there (a LoRA saved beside the model) left out; in a folder of other
    names, every file (or the shards an index names).
    """
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise SafetensorsError(f"{path}: {missing_or_not_regular(path)}")
    entries = sorted(os.listdir(path))
    dot = f".{variant}" if variant else ""
    for stem, index_first in _LOADERS:
        single, index = f"{stem}{dot}.safetensors", f"{stem}.safetensors.index{dot}.json"
        for name in (index, single) if index_first else (single, index):
            if name in entries:
                return _indexed(path, [name]) if name == index else [os.path.join(path, name)]
    indexes = [name for name in entries if name.endswith(f".safetensors.index{dot}.json")]
    if indexes:
        return _indexed(path, indexes)
    names = [name for name in entries if name.endswith(".safetensors")]
    if not names:
        raise SafetensorsError(f"{path}: no .safetensors files in this folder")
    variants = {name: _variant(name) for name in names}
    found = sorted({v for v in variants.values() if v})
    if variant:
        names = [name for name in names if variants[name] == variant]
        if not names:
            have = f"its variants: {', '.join(found)}" if found else "it holds no variant files"
            raise SafetensorsError(
                f"{path}: no weights of variant {variant!r} in this folder ({have}); fix the component's variant"
            )
    elif "" in variants.values():  # the plain weights: what from_pretrained loads, nothing beside them
        names = [name for name in names if variants[name] == ""]
    elif len(found) > 1:
        raise SafetensorsError(
            f"{path}: this folder holds the weights in {len(found)} variants ({', '.join(found)}) and no plain "
            "ones; set the component's variant to the one the server loads"
        )
    elif found:  # one variant and no plain weights: those, without the other files beside them
        names = [name for name in names if variants[name] == found[0]]
    return [os.path.join(path, name) for name in names]


def _indexed(folder: str, indexes: list[str]) -> list[str]:
    """The shards the index files (names in ``folder``) name, each there."""
    from .files import CheckpointNotFound, indexed_shards

    try:
        return indexed_shards(folder, [os.path.join(folder, name) for name in indexes])
    except CheckpointNotFound as exc:
        raise SafetensorsError(str(exc)) from None
