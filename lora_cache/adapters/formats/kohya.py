"""kohya sd-scripts files: ``lora_unet_<module_with_underscores>.lora_down.weight``,
``.lora_up.weight`` and ``.alpha`` (``lora_te_`` / ``lora_te1_`` / ``lora_te2_`` for text
encoders, ``lora_transformer_`` for DiTs), ``ss_network_alpha`` in the header (a record of
the training command, never read as an alpha: :mod:`lora_cache.adapters.alpha`). Which model
module an underscored stem names is decided in :mod:`lora_cache.targets.keys`; a kohya Flux file
with the BFL names is :mod:`.kohya_flux`."""

from __future__ import annotations

__all__ = ["NAME", "ROLES", "claims", "read"]

NAME = "kohya"
ROLES = (("lora_down.weight", "down"), ("lora_up.weight", "up"), ("alpha", "alpha"))
PREFIXES = ("lora_unet_", "lora_te", "lora_transformer_")


def claims(keys, metadata: dict) -> bool:
    return any(key.startswith(PREFIXES) for key in keys)


def read(reading):
    return reading.build()
