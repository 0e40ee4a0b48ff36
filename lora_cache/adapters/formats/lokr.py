"""LyCORIS LoKr files: ``<module>.lokr_w1`` (or ``.lokr_w1_a`` / ``.lokr_w1_b``), ``.lokr_w2``
(or ``.lokr_w2_a`` / ``.lokr_w2_b``, with a Tucker core ``.lokr_t2`` on a conv): a Kronecker
product of the two, with ``.alpha`` and ``.dora_scale``, under kohya's names or LyCORIS's.
Read by lora_cache's reader, on a diffusers model too; merged with LyCORIS's math
(:mod:`lora_cache.terms.lycoris_math`), alpha / rank applying only where a half is stored as a
pair (:mod:`lora_cache.adapters.lycoris_parts`)."""

from __future__ import annotations

__all__ = ["DIFFUSERS_READS", "NAME", "PARTS", "ROLES", "claims", "read"]

NAME = "lycoris-lokr"
PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")  # each key's suffix, and its role
ROLES = tuple((part, part) for part in PARTS)
DIFFUSERS_READS = False


def claims(keys, metadata: dict) -> bool:
    return any(key.rpartition(".")[2] in PARTS for key in keys)


def read(reading):
    return reading.build()
