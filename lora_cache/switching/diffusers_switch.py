"""diffusers' ``set_adapters(names, weights)``, served by :func:`lora_cache.set_adapters`.

A diffusers server loads adapters once under names and then calls
``pipe.set_adapters(["turbo", "style"], [1.0, 0.6])`` per request; with ``fuse_lora``
every such switch re-merges in anonymous memory. Here the names map to the adapter
files, and each combination of names and weights is a cached combination (re-pointed
at mapped files) or served at run time while it is built (see
:mod:`lora_cache.switching.adapter_switch`).
"""

from __future__ import annotations

import numbers
import os

import torch

from hostmem.errors import InputError
from .adapter_switch import SwitchResult, set_adapters
from ..adapters import AdapterError
from ..diffusers_entry import _model_of, _specs

__all__ = ["set_pipeline_adapters"]


def _weight(w) -> float | None:
    """A weight as a float (None: 1.0, as diffusers reads it); None where it is no real number.

    Any real scalar is one: a Python or numpy number, or a 0-d torch tensor. A bool is read
    as 1.0 or 0.0, as diffusers reads it."""
    if w is None:
        return 1.0
    if isinstance(w, numbers.Real):
        return float(w)
    if isinstance(w, torch.Tensor) and w.ndim == 0 and not w.is_complex():
        return float(w)
    return None


def _weights(names: list[str], adapter_weights) -> list[float]:
    """One float per name, as diffusers takes them (None: 1.0 each, and 1.0 for a None
    in the list; one number: for all)."""
    if isinstance(adapter_weights, dict):
        raise InputError("set_pipeline_adapters: per-component or per-block weights (dicts) are not supported; "
                         "give one number per adapter")
    one = _weight(adapter_weights)
    if one is not None:
        return [one] * len(names)
    try:
        weights = list(adapter_weights)
    except TypeError:
        raise InputError(f"set_pipeline_adapters: weights {adapter_weights!r} is neither a number nor a list of "
                         "numbers; give one number per adapter") from None
    if len(weights) != len(names):
        raise InputError(f"set_pipeline_adapters: {len(names)} adapter name(s) but {len(weights)} weight(s); "
                         "give one weight per name")
    floats = []
    for name, w in zip(names, weights):
        if isinstance(w, dict):
            raise InputError(f"set_pipeline_adapters: the weight of {name!r} is a dict; per-component or per-block "
                             "weights (dicts) are not supported, give one number per adapter")
        value = _weight(w)
        if value is None:
            raise InputError(f"set_pipeline_adapters: the weight of {name!r}, {w!r}, is not a real number; give a "
                             "number (a Python or numpy number, a 0-d tensor, or None for 1.0)")
        floats.append(value)
    return floats


def set_pipeline_adapters(pipe_or_model, adapter_names, adapter_weights=None, *, files: dict,
                          cache_root: str | os.PathLike, weight_name: str | None = None, **options) -> SwitchResult:
    """Switch a diffusers pipeline (or model) to ``adapter_names`` at ``adapter_weights``.

    ``files`` maps each name to what ``load_lora_weights`` would take (a file, or a folder
    with ``weight_name``); ``[]`` switches to the base. ``adapter_weights`` are read as
    diffusers' ``set_adapters`` reads them: None (1.0 each), one number for all, or one per
    name, each a Python or numpy number, a 0-d tensor, or None (1.0); per-component dicts
    are refused, and so are NaN and infinite weights. ``options`` go to
    :func:`lora_cache.set_adapters` (``max_size``, ``background``, ``shards`` for a
    tensor-parallel rank, named as :func:`lora_cache.load_lora` names them, ...).
    """
    names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
    missing = [n for n in names if n not in files]
    if missing:
        raise AdapterError(
            f"set_pipeline_adapters: no file for adapter name(s) {', '.join(map(repr, missing))}; "
            f"files names {', '.join(map(repr, sorted(files))) or 'none'}. Add files={{name: path}} for each name"
        )
    specs = [spec for name, weight in zip(names, _weights(names, adapter_weights))
             for spec in _specs(files[name], weight, weight_name)]
    return set_adapters(_model_of(pipe_or_model, specs), specs, cache_root, **options)
