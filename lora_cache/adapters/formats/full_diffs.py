"""Full weight differences: ``<module>.diff`` (a weight) and ``.diff_b`` (a bias), merged as
``W += strength * diff``. ComfyUI and lightx2v write them beside LoRA factors; LyCORIS's
"full" algorithm writes nothing else (its ``FullModule`` saves the trained weight minus
the original). For a diffusers model they are placed by diffusers' single-file converter
(:mod:`lora_cache.adapters.full_diffs`). LyCORIS's norm modules (``.w_norm``, ``.b_norm``)
are such differences of a norm's weight and bias: LyCORIS's ``NormModule`` adds them at the
multiplier, as ComfyUI adds them (its loader reads them as ``diff`` patches)."""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "claims", "read"]

NAME = "full-diffs"
ROLES = (("diff", "diff"), ("diff_b", "diff_b"), ("w_norm", "diff"), ("b_norm", "diff_b"))


def claims(keys, metadata: dict) -> bool:
    return any(key.endswith((".diff", ".diff_b", ".w_norm", ".b_norm")) for key in keys)


def read(reading):
    return reading.build()
