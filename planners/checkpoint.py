"""Component sizes from a checkpoint's safetensors headers, without loading a weight.

A header is a few KiB of JSON at the front of each file, so sizing a 60 GB
checkpoint reads kilobytes and takes milliseconds. Tensors are grouped into layers
by the component's name pattern (``"blocks.{i}."``); what matches no layer is the
component's ``rest``.
"""

from __future__ import annotations

import json
import math
import os
import re

from hostmem.safetensors.header import DTYPE_SIZES, SafetensorsError, SafetensorsHeader, read_header
from hostmem.units import format_size

from .kept_fp32 import kept_in_fp32
from .sizes import ComponentSizes, group_layers, rest_families, with_lora_target_bytes

__all__ = ["checkpoint_files", "diffusers_class", "diffusers_config", "read_headers", "read_checkpoint"]


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
        raise SafetensorsError(f"{path}: no such file or folder")
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
    from hostmem.remapping.files import CheckpointNotFound, indexed_shards

    try:
        return indexed_shards(folder, [os.path.join(folder, name) for name in indexes])
    except CheckpointNotFound as exc:
        raise SafetensorsError(str(exc)) from None


def diffusers_config(checkpoint: str) -> dict | None:
    """The ``config.json`` diffusers wrote beside a checkpoint (a file's folder is looked
    in), or None: no such file, or not a JSON object."""
    folder = checkpoint if os.path.isdir(checkpoint) else os.path.dirname(checkpoint)
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def diffusers_class(checkpoint: str) -> str | None:
    """The diffusers model class a checkpoint folder's ``config.json`` names (``_class_name``),
    or None: no such file, not JSON, or no class named (a file's folder is looked in)."""
    name = (diffusers_config(checkpoint) or {}).get("_class_name")
    return name if isinstance(name, str) and name.isidentifier() else None


def read_headers(path: str, variant: str | None = None) -> list[SafetensorsHeader]:
    """Headers of every file of the checkpoint (``variant``: see :func:`checkpoint_files`);
    a tensor in two files is an error."""
    headers = [read_header(f) for f in checkpoint_files(path, variant)]
    seen: dict[str, str] = {}
    for header in headers:
        for name in header.tensors:
            if name in seen:
                raise SafetensorsError(
                    f"{header.path}: tensor {name!r} is also in {seen[name]}; a checkpoint holds each tensor once"
                )
            seen[name] = header.path
    return headers


def read_checkpoint(
    name: str,
    offload: str,
    path: str,
    pattern: str | None,
    lora_patterns: tuple[str, ...] = (),
    lora_target_bytes: int | None = None,
    dtype: str | None = None,
    headers: list[SafetensorsHeader] | None = None,
) -> ComponentSizes:
    """Sizes of component ``name`` from the headers under ``path``.

    Residency is not known before loading: every byte starts not resident, and
    ``planners.whatif.predict`` says where the bytes will live. A pattern that
    matches no tensor leaves ``layers`` empty; the caller says which key to fix.
    ``headers``: what :func:`read_headers` gave for ``path`` already (a plan reads them once).
    """
    headers = read_headers(path) if headers is None else headers
    keep = kept_in_fp32(diffusers_config(path), dtype)
    named, cast = served_tensors(headers, dtype, keep)
    layers, rest = group_layers(named, pattern, lora_patterns, cast)
    sizes = ComponentSizes(name, offload, "headers", layers, rest, dtype=dtype,
                           rest_families=rest_families(named, pattern))
    if cast:
        stored = sum(info.nbytes for header in headers for info in header.tensors.values() if info.name in cast)
        held = sum(n for t, n, _ in named if t in cast)
        sizes = sizes._replace(notes=(*sizes.notes, f"{name}: {len(cast)} tensors stored as {_stored_names(headers, cast)} "
                                      f"are served as {dtype} (components.{name}.dtype){_kept_words(cast, keep)}: "
                                      f"{format_size(held)} of copies (anonymous, never views of the file) for "
                                      f"{format_size(stored)} on disk"))
    return with_lora_target_bytes(sizes, lora_target_bytes) if lora_target_bytes else sizes


_SERVED = {"bf16": "BF16", "fp16": "F16", "fp32": "F32", "fp8": "F8_E4M3"}  # a cast at load (int8: a quantization)
_FLOATS = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


def served_tensors(headers: list[SafetensorsHeader], dtype: str | None, keep=None) -> tuple[list, frozenset[str]]:
    """``([(name, bytes as served, None)], names cast)``: each tensor at the size the server
    holds it in. A floating tensor stored in another dtype than ``dtype`` (a float one) is
    cast at load, as ``from_pretrained(torch_dtype=...)`` casts it: a copy at the served
    size; one the model class keeps in fp32 (``keep``: :func:`planners.kept_fp32.kept_in_fp32`)
    is served as fp32, a copy where it is stored in another dtype."""
    served = _SERVED.get(dtype or "")
    named, cast = [], set()
    for header in headers:
        for info in header.tensors.values():
            nbytes, wanted = info.nbytes, served
            if wanted is not None and keep and keep.keeps(info.name):
                wanted = "F32"
            if wanted is not None and info.dtype in _FLOATS and info.dtype != wanted:
                nbytes = math.prod(info.shape) * DTYPE_SIZES[wanted]
                cast.add(info.name)
            named.append((info.name, nbytes, None))
    return named, frozenset(cast)


def _kept_words(cast: frozenset[str], keep) -> str:
    kept = sum(1 for t in cast if keep and keep.keeps(t))
    return f", {kept} of them in fp32, as the model class keeps {', '.join(keep.modules)}" if kept else ""


def _stored_names(headers: list[SafetensorsHeader], cast: frozenset[str]) -> str:
    return "/".join(sorted({info.dtype for h in headers for info in h.tensors.values() if info.name in cast}))
