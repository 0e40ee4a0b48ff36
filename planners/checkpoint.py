"""Component sizes from a checkpoint's safetensors headers, without loading a weight.

A header is a few KiB of JSON at the front of each file, so sizing a 60 GB
checkpoint reads kilobytes and takes milliseconds. Tensors are grouped into layers
by the component's name pattern (``"blocks.{i}."``); what matches no layer is the
component's ``rest``.
"""

from __future__ import annotations

import json
import os

from hostmem.safetensors.header import SafetensorsError, SafetensorsHeader, read_header

from .sizes import ComponentSizes, group_layers, with_lora_target_bytes

__all__ = ["checkpoint_files", "diffusers_class", "diffusers_config", "read_headers", "read_checkpoint"]


def checkpoint_files(path: str) -> list[str]:
    """The ``.safetensors`` files of ``path`` (a file, or a folder's files in name order)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise SafetensorsError(f"{path}: no such file or folder")
    files = sorted(
        os.path.join(path, name) for name in os.listdir(path) if name.endswith(".safetensors")
    )
    if not files:
        raise SafetensorsError(f"{path}: no .safetensors files in this folder")
    return files


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


def read_headers(path: str) -> list[SafetensorsHeader]:
    """Headers of every file of the checkpoint; a tensor in two files is an error."""
    headers = [read_header(f) for f in checkpoint_files(path)]
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
    named = [(info.name, info.nbytes, None) for header in headers for info in header.tensors.values()]
    layers, rest = group_layers(named, pattern, lora_patterns)
    sizes = ComponentSizes(name, offload, "headers", layers, rest, dtype=dtype)
    return with_lora_target_bytes(sizes, lora_target_bytes) if lora_target_bytes else sizes
