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

from hostmem.remapping.folder import checkpoint_files
from hostmem.safetensors.header import DTYPE_SIZES, SafetensorsError, SafetensorsHeader, read_header
from hostmem.units import format_size

from .kept_fp32 import kept_in_fp32
from .sizes import ComponentSizes, group_layers, rest_families, with_lora_target_bytes

__all__ = ["checkpoint_files", "diffusers_class", "diffusers_config", "read_headers", "read_checkpoint"]


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
