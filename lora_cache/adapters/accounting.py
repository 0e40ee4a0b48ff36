"""Every key of an adapter file accounted for, through diffusers' converters too.

This package's reader refuses a key it does not understand, and the key resolution
names the keys that match no module (:func:`lora_cache.targets.keys.resolve_adapter`). A
converter of diffusers' can drop keys on its own (Wan's drops norm diffs and
``time_projection`` keys, logging at DEBUG), and a file may change a component the
model lacks (a kohya SD file's ``lora_te_`` keys, merged into a pipeline without its
text encoder). Both are held to the same rule: with ``strict`` (the default) the load
fails naming the keys left over; with ``strict=False`` one warning names how many and
the first few, and the rest applies, as diffusers' own loader does with keys it
cannot place.

What a converter dropped is found by converting a probe of the file: each module's
factors replaced by rank-1 ones whose down row carries the module's number (as the
ratio of its first two values, which survives the alpha the converter folds into
it, and copies and splits of the row). A module whose number comes out of the
probe nowhere was dropped. The probe is as small as the file's widths, not its ranks.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import torch

from .spec import AdapterError

__all__ = ["dropped_bias_diffs", "dropped_by_converter", "dropped_dora_scales", "left_over"]

_SHOWN = 5


def left_over(path: str, keys: list[str], why: str, strict: bool, other_way: str = "") -> None:
    """Raise for ``keys`` the merge does not use (``why`` says what became of them), or,
    with ``strict=False``, warn once naming how many and the first few. ``other_way``: a
    way to merge them all, said in the refusal before strict=False (which merges only the rest)."""
    if not keys:
        return
    keys = sorted(keys)
    shown = ", ".join(keys[:_SHOWN]) + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")
    if strict:
        raise AdapterError(
            f"{path}: {len(keys)} key(s) {why}: {shown}. Merging the rest would not be the adapter the file holds; "
            f"{other_way + ', or ' if other_way else ''}pass strict=False (config: strict: false) to merge only "
            "the rest, with a warning"
        )
    warnings.warn(f"{path}: {len(keys)} key(s) {why}: {shown}; strict=False, so the rest is merged", stacklevel=4)


def _marked(change, number: int) -> dict | None:
    """Rank-1 probe factors of one module, its down row carrying ``number``."""
    down, up = change.parts["down"], change.parts["up"]
    row = torch.zeros((1, *down.shape[1:]), dtype=torch.float32)
    if row.numel() < 2:
        return None
    row.view(-1)[0], row.view(-1)[1] = float(number), 1.0
    return {change.keys["down"]: row, change.keys["up"]: torch.ones((up.shape[0], 1, *up.shape[2:]))}


def _numbers(tensor: torch.Tensor) -> set[int]:
    """The module numbers a converted down matrix's rows carry."""
    rows = tensor.detach().float().reshape(tensor.shape[0], -1) if tensor.dim() >= 2 else None
    if rows is None or rows.shape[1] < 2:
        return set()
    found = set()
    for first, second in rows[:, :2].tolist():
        if second != 0 and abs(first / second - round(first / second)) < 1e-3:
            found.add(round(first / second))
    return found


def _is_down(key: str) -> bool:
    return key.endswith(".weight") and any(m in key for m in ("lora_A", "lora_down", "lora.down", "down."))


@contextmanager
def _quiet():
    """diffusers' log lines about the probe: it said them of the file itself already."""
    logger = logging.getLogger("diffusers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def dropped_by_converter(convert, fed: dict, modules: dict) -> list[str]:
    """The keys of ``fed`` (what a converter was given) whose modules ``convert`` (a function
    of a state dict, returning its converted state dict) drops; [] when the probe tells
    nothing (the converter refuses it, or no number comes through: a converter that
    rounds the factors to a narrow dtype would blur every number, and a file is never
    refused on a guess)."""
    probe, numbered = {}, {}
    for number, change in enumerate(modules.values(), start=1):
        if "down" not in change.keys or change.keys["down"] not in fed:
            continue
        marked = _marked(change, number)
        if marked is not None:
            probe.update(marked)
            numbered[number] = change
    if not numbered:
        return []
    probe.update({key: value.clone() for key, value in fed.items() if key.endswith(".alpha")})
    try:
        with _quiet():
            converted = convert(probe)
    except Exception:  # noqa: BLE001 - a probe the converter refuses tells nothing; the real file converted
        return []
    seen = set().union(*(_numbers(v) for k, v in converted.items() if torch.is_tensor(v) and _is_down(k)))
    if not seen & set(numbered):
        return []
    return sorted(k for n, change in numbered.items() if n not in seen
                  for k in change.keys.values() if k in fed)


def dropped_dora_scales(fed: dict, state: dict) -> list[str]:
    """The ``dora_scale`` keys of ``fed`` a converter did not carry into ``state`` as peft's
    magnitude vectors (diffusers' SD loader filters them out with a warning, which would
    merge a DoRA as plain LoRA): the probe of :func:`dropped_by_converter` follows the
    factors, and a module whose factors survive keeps it from seeing these."""
    scales = sorted(key for key in fed if key.endswith(".dora_scale"))
    carried = sum(1 for key in state if "lora_magnitude_vector" in key)
    return scales if carried < len(scales) else []


def dropped_bias_diffs(fed: dict, state: dict) -> list[str]:
    """The ``.diff_b`` keys of ``fed`` (beside LoRA factors: peft's ``lora_B.bias`` to a
    converter) that did not come through as ``lora_B.bias``: a converter that drops them
    keeps the factors, so the probe of :func:`dropped_by_converter` cannot see it."""
    biases = sorted(key for key in fed if key.endswith(".diff_b"))
    carried = sum(1 for key in state if key.endswith(".lora_B.bias"))
    return biases if carried < len(biases) else []
