"""LyCORIS LoCon with a Tucker core (``use_tucker`` on a conv of kernel over 1x1):
``<module>.lora_down.weight`` (rank, in, 1, 1), ``.lora_mid.weight`` (rank, rank, kh, kw),
``.lora_up.weight`` (out, rank, 1, 1), ``.alpha``, under kohya's names or LyCORIS's.
diffusers' converters drop or misread the core, so lora_cache's reader takes such a file;
merged as ``up @ (mid x down)`` (:mod:`lora_cache.terms.lycoris_math`)."""

from __future__ import annotations

__all__ = ["DIFFUSERS_READS", "NAME", "ROLES", "claims", "read"]

NAME = "lycoris-locon-tucker"
ROLES = (("lora_mid.weight", "mid"),)
DIFFUSERS_READS = False


def claims(keys, metadata: dict) -> bool:
    return any(key.endswith(".lora_mid.weight") for key in keys)


def read(reading):
    return reading.build()
