"""ComfyUI and lightx2v files: ``diffusion_model.<module>.lora_down.weight``,
``.lora_up.weight`` and ``.alpha`` (kohya's suffixes, :mod:`.kohya`), beside full weight
differences (:mod:`.full_diffs`), under the original checkpoint's module names."""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "claims", "read"]

NAME = "comfyui"
ROLES: tuple = ()  # kohya's suffixes and the full diffs', declared where they belong
PREFIXES = ("diffusion_model.", "model.diffusion_model.")


def claims(keys, metadata: dict) -> bool:
    return any(key.startswith(PREFIXES) for key in keys)


def read(reading):
    return reading.build()
