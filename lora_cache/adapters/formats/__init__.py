"""Adapter formats, one module each, tried from one list.

:data:`FORMATS` is the order the reader tries them in: a file is read by the first whose
``claims(keys, metadata)`` holds (the interface is in :mod:`.base`). Every module's
``ROLES`` (the key suffixes it names, and what each part is) make the reader's one suffix
table, :func:`split_key`. A new format is one new file here and one line in the list.

The list is ordered from the most specific to the least: refused variants first (an IA3
file must never be read as plain LoRA), LyCORIS's factored kinds next (a LoHa under
kohya's names is LyCORIS's, not kohya's), then the prefixes of the trainers and tools, and
:mod:`.plain` last. :mod:`.kohya_flux` is not tried on its own: a kohya BFL Flux file is
:mod:`.kohya`'s, read by kohya_flux's rules where diffusers' converter cannot take the
model's sizes (:mod:`lora_cache.adapters.diffusers_format`). The converter itself is
chosen by the model, not the file (:mod:`lora_cache.adapters.for_model`).
"""

from __future__ import annotations

from . import comfyui, diffusers, full_diffs, kohya, kohya_flux, locon_tucker, loha, lokr, lycoris, peft, plain, refused
from .base import Reading

__all__ = ["FORMATS", "ROLES", "Reading", "detect", "known_parts", "split_key"]

FORMATS = (
    refused,
    loha,
    lokr,
    locon_tucker,
    kohya,
    comfyui,
    diffusers,
    peft,
    lycoris,
    full_diffs,
    plain,
)

# Suffix -> role over every format (and kohya_flux's), longest first so that no shorter
# suffix takes a key a longer one names.
ROLES: tuple = tuple(sorted({pair for fmt in (*FORMATS, kohya_flux) for pair in fmt.ROLES},
                            key=lambda pair: (-len(pair[0]), pair[0])))


def split_key(key: str) -> tuple[str, str] | None:
    """``(stem, role)`` of a key some format names (``x.lora_down.weight`` -> ``("x", "down")``), else None."""
    for suffix, role in ROLES:
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], role
    return None


def known_parts() -> str:
    """The suffixes the formats name, for a message about a key none of them does."""
    return ", ".join(suffix for suffix, _ in ROLES)


def detect(keys, metadata: dict):
    """The first format module of :data:`FORMATS` that claims a file with these keys."""
    keys = list(keys)
    return next(fmt for fmt in FORMATS if fmt.claims(keys, metadata))
