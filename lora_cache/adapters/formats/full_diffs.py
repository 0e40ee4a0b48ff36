"""Full weight differences: ``<module>.diff`` (a weight) and ``.diff_b`` (a bias), merged as
``W += strength * diff``. ComfyUI and lightx2v write them beside LoRA factors; LyCORIS's
"full" algorithm writes nothing else (its ``FullModule`` saves the trained weight minus
the original). For a diffusers model they are placed by diffusers' single-file converter
(:mod:`lora_cache.adapters.full_diffs`)."""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "claims", "read"]

NAME = "full-diffs"
ROLES = (("diff", "diff"), ("diff_b", "diff_b"))


def claims(keys, metadata: dict) -> bool:
    return any(key.endswith((".diff", ".diff_b")) for key in keys)


def read(reading):
    return reading.build()
