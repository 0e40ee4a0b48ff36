"""LyCORIS LoHa files: ``<module>.hada_w1_a``, ``.hada_w1_b``, ``.hada_w2_a``, ``.hada_w2_b``
(a Hadamard product of two low-rank pairs), ``.hada_t1`` / ``.hada_t2`` (Tucker cores of a
conv), ``.alpha`` and ``.dora_scale``, under kohya's names (``lora_unet_``, ``lora_te_``) or
LyCORIS's (``lycoris_``). Read by lora_cache's reader, on a diffusers model too (diffusers'
converters do not take them); merged with LyCORIS's math (:mod:`lora_cache.terms.lycoris_math`)."""

from __future__ import annotations

__all__ = ["DIFFUSERS_READS", "NAME", "PARTS", "ROLES", "claims", "read"]

NAME = "lycoris-loha"
PARTS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")  # each key's suffix, and its role
ROLES = tuple((part, part) for part in PARTS)
DIFFUSERS_READS = False


def claims(keys, metadata: dict) -> bool:
    return any(key.rpartition(".")[2] in PARTS for key in keys)


def read(reading):
    return reading.build()
