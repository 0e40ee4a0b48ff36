"""diffusers' own files: ``transformer.<module>.lora_A.weight`` / ``.lora_B.weight`` (peft's
suffixes, :mod:`.peft`) with or without ``lora_adapter_metadata`` in the header, and the
older ``<module>.lora.down.weight`` / ``.up.weight`` spelling (also XLabs' Flux layout,
``processor.qkv_lora1.down.weight``). For a diffusers model the keys are converted by
diffusers itself (:mod:`lora_cache.adapters.diffusers_format`), chosen by the model, not
by the file."""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "claims", "read"]

NAME = "diffusers"
ROLES = (("down.weight", "down"), ("up.weight", "up"))
PREFIXES = ("transformer.", "unet.")


def claims(keys, metadata: dict) -> bool:
    return "lora_adapter_metadata" in metadata or any(key.startswith(PREFIXES) for key in keys)


def read(reading):
    return reading.build()
