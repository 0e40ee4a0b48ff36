"""peft's files: ``base_model.model.<module>.lora_A.weight`` (down), ``.lora_B.weight`` (up),
``.lora_B.bias`` (``lora_bias``), ``.lora_magnitude_vector`` (DoRA, merged as peft merges
it: :mod:`lora_cache.compute.merge_math`), and the ``.lora_A.default.weight`` infix
DiffSynth-Studio writes. Rank and alpha come from the ``adapter_config.json`` peft wrote
beside the file (:mod:`lora_cache.adapters.alpha`)."""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "claims", "read"]

NAME = "peft"
ROLES = (
    ("lora_A.weight", "down"),
    ("lora_A.default.weight", "down"),
    ("lora_B.weight", "up"),
    ("lora_B.default.weight", "up"),
    ("lora_B.bias", "up_b"),  # diffusers also turns ComfyUI's diff_b beside factors into it
    ("lora_magnitude_vector", "magnitude"),
)


def claims(keys, metadata: dict) -> bool:
    return any(".lora_A." in key for key in keys)


def read(reading):
    return reading.build()
