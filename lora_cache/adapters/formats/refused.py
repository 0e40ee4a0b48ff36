"""Adapter variants whose weight change is not ``W + scale * B @ A`` and that lora_cache does
not merge: refused by name, with the key, never read as plain LoRA (which would merge a
wrong weight without any error).

LyCORIS's LoHa (a Hadamard product of two low-rank pairs) and LoKr (a Kronecker
product), LoCon's Tucker core, IA3, OFT, norm adapters and peft's embedding LoRA. Listed
first in :data:`~lora_cache.adapters.formats.FORMATS`, and checked on every key wherever
keys are grouped (a converter's path included).
"""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "VARIANTS", "claims", "read", "refuse", "variant_of"]

NAME = "refused"
ROLES: tuple = ()

# A key's last or second-to-last part -> the variant it marks.
VARIANTS = {
    "hada_w1_a": "LoHa",
    "hada_w1_b": "LoHa",
    "hada_w2_a": "LoHa",
    "hada_w2_b": "LoHa",
    "hada_t1": "LoHa",
    "hada_t2": "LoHa",
    "lokr_w1": "LoKr",
    "lokr_w1_a": "LoKr",
    "lokr_w1_b": "LoKr",
    "lokr_w2": "LoKr",
    "lokr_w2_a": "LoKr",
    "lokr_w2_b": "LoKr",
    "lokr_t2": "LoKr",
    "lora_mid": "LoCon with a Tucker core (lora_mid)",
    "lora_embedding_A": "embedding LoRA",
    "lora_embedding_B": "embedding LoRA",
    "ia3_l": "IA3",
    "oft_blocks": "OFT",
    "oft_r": "OFT",
    "w_norm": "norm adapter (w_norm)",
    "b_norm": "norm adapter (b_norm)",
}


def variant_of(key: str) -> str | None:
    """The refused variant ``key`` belongs to, or None (the marker is the key's suffix)."""
    for part in key.split(".")[-2:]:
        if part in VARIANTS:
            return VARIANTS[part]
    return None


def refuse(path: str, key: str) -> None:
    """Raise :class:`UnsupportedAdapterError` when ``key`` belongs to a refused variant."""
    variant = variant_of(key)
    if variant is not None:
        from ..spec import UnsupportedAdapterError  # the plan's header reading lists formats without it

        raise UnsupportedAdapterError(
            f"{path}: key {key!r} belongs to a {variant} adapter, which lora_cache does not "
            "merge (its weights are not W + scale * B @ A); convert it to plain LoRA or apply "
            "it at run time instead"
        )


def claims(keys, metadata: dict) -> bool:
    return any(variant_of(key) is not None for key in keys)


def read(reading):
    for key in sorted(reading.tensors):
        refuse(reading.path, key)
    return reading.build()  # not reached: read only where claims() found a refused key
