"""Which file an adapter path names, and which peft config describes it (no torch).

A path may be the adapter file or the folder its trainer wrote: peft's
``save_pretrained`` (``adapter_model.safetensors`` with its ``adapter_config.json``) or
diffusers' ``save_lora_weights`` (``pytorch_lora_weights.safetensors``), or their ``.bin``
(``safe_serialization=False``). The adapter
reader (:func:`lora_cache.adapters.read.resolve_file`) and the planner's header reading
(:mod:`lora_cache.targets.header_targets`) both ask here, so they read the same file.
"""

from __future__ import annotations

import os

__all__ = ["FOLDER_FILES", "PEFT_FILES", "adapter_file_in", "peft_config_path"]

# The file a trainer's folder holds: peft's save_pretrained, diffusers' save_lora_weights.
FOLDER_FILES = ("adapter_model.safetensors", "pytorch_lora_weights.safetensors", "adapter_model.bin",
                "pytorch_lora_weights.bin")
# The files peft's save_pretrained writes beside its adapter_config.json: the config is theirs alone.
PEFT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def adapter_file_in(path: str) -> tuple[str | None, str]:
    """``(file, "")``: the adapter file ``path`` names (itself, or the file the trainer wrote
    into a folder); ``(None, why)`` for a folder that names none."""
    if not os.path.isdir(path):
        return path, ""
    for name in FOLDER_FILES:
        inner = os.path.join(path, name)
        if os.path.exists(inner):
            return inner, ""
    found = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if len(found) == 1:
        return os.path.join(path, found[0]), ""
    listed = f"it holds {', '.join(found)}" if found else "it holds no .safetensors file"
    return None, f"{path}: a folder without {' or '.join(FOLDER_FILES)}, and {listed}; name the .safetensors file"


def peft_config_path(path: str) -> str | None:
    """The ``adapter_config.json`` that describes the adapter file ``path``: the one beside
    it when ``path`` is the file peft wrote with it, else None (an unrelated file in the
    same folder is not described by it)."""
    if os.path.basename(path) not in PEFT_FILES:
        return None
    config = os.path.join(os.path.dirname(path), "adapter_config.json")
    return config if os.path.exists(config) else None
