"""LyCORIS files: kohya's names and suffixes (``lycoris_`` or ``lora_unet_`` stems,
``.lora_down.weight`` / ``.lora_up.weight`` / ``.alpha``), with two parts of its own that
lora_cache merges:

- ``.dora_scale``: LyCORIS's DoRA (weight decomposition), merged as ComfyUI merges it
  (:mod:`lora_cache.lycoris_dora`): its shape says the normed axis, ``(out, 1)`` for
  ``wd_on_out`` (each output row), ``(1, in)`` otherwise (each input column);
- the "full" algorithm's ``.diff`` / ``.diff_b`` (:mod:`.full_diffs`).

LoHa, LoKr and LoCon's Tucker core are formats of their own (:mod:`.loha`, :mod:`.lokr`,
:mod:`.locon_tucker`, tried before kohya's, whose names they share); IA3, OFT and GLoRA
are refused by name (:mod:`.refused`).
"""

from __future__ import annotations

__all__ = ["DIFFUSERS_READS", "NAME", "ROLES", "claims", "read"]

NAME = "lycoris"
ROLES = (("dora_scale", "dora_scale"),)
DIFFUSERS_READS = False  # diffusers' converters know neither its names nor its DoRA: lora_cache's reader takes it


def claims(keys, metadata: dict) -> bool:
    return any(key.startswith("lycoris_") or key.endswith(".dora_scale") for key in keys)


def read(reading):
    return reading.build()
