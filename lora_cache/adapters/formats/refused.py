"""Adapter variants whose weight change lora_cache does not merge: refused by name, with the
key, the layout and what to do, never read as plain LoRA (which would merge a wrong weight
without any error).

LyCORIS's IA3 (a per-channel scale of the weight), OFT and BOFT (a rotation of it),
GLoRA (a change that multiplies the weight itself), and peft's embedding LoRA (its norm
adapters are full differences: :mod:`.full_diffs`). Listed first in :data:`~lora_cache.adapters.formats.FORMATS`, and
checked on every key wherever keys are grouped (a converter's path included). LyCORIS's
LoHa, LoKr and LoCon's Tucker core are merged (:mod:`.loha`, :mod:`.lokr`,
:mod:`.locon_tucker`).
"""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "VARIANTS", "claims", "read", "refuse", "variant_of"]

NAME = "refused"
ROLES: tuple = ()

_MERGE_ELSEWHERE = ("merge it into the checkpoint with the tool that trained it (LyCORIS's merge script, peft's "
                    "merge_and_unload) and load the merged checkpoint")
_IA3 = "IA3 (a per-channel scale of the weight: <module>.weight with <module>.on_input)"
_OFT = "OFT or BOFT (an orthogonal rotation of the weight: <module>.oft_blocks or .oft_diag)"
_GLORA = "GLoRA (a change that multiplies the weight itself: <module>.a1/a2/b1/b2.weight)"
# A key's last part -> the variant it marks.
VARIANTS = {
    "lora_embedding_A": "embedding LoRA",
    "lora_embedding_B": "embedding LoRA",
    "ia3_l": "IA3",
    "on_input": _IA3,
    "oft_blocks": _OFT,
    "oft_diag": _OFT,
    "oft_r": "OFT",
}
# A key's last two parts -> the variant they mark (GLoRA's ``a1.weight``: a ``.weight`` key
# alone marks nothing).
_PAIRS = {(part, "weight"): _GLORA for part in ("a1", "a2", "b1", "b2")}


def variant_of(key: str) -> str | None:
    """The refused variant ``key`` belongs to, or None (the marker is the key's suffix)."""
    parts = key.split(".")
    found = VARIANTS.get(parts[-1]) or _PAIRS.get(tuple(parts[-2:]))
    if found is None and len(parts) > 1:
        found = VARIANTS.get(parts[-2])  # peft's lora_embedding_A.<adapter>
    return found


def refuse(path: str, key: str) -> None:
    """Raise :class:`UnsupportedAdapterError` when ``key`` belongs to a refused variant."""
    variant = variant_of(key)
    if variant is not None:
        from ..spec import UnsupportedAdapterError  # the plan's header reading lists formats without it

        raise UnsupportedAdapterError(
            f"{path}: key {key!r} belongs to an adapter of a kind lora_cache does not merge, {variant}: its change "
            f"is no sum of LoRA, LoHa or LoKr terms. To use it, {_MERGE_ELSEWHERE}, or convert it to plain LoRA"
        )


def claims(keys, metadata: dict) -> bool:
    return any(variant_of(key) is not None for key in keys)


def read(reading):
    for key in sorted(reading.tensors):
        refuse(reading.path, key)
    return reading.build()  # not reached: read only where claims() found a refused key
