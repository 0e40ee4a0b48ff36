"""diffusers' ``set_adapters(names, weights)``, served by :func:`lora_cache.set_adapters`.

A diffusers server loads adapters once under names and then calls
``pipe.set_adapters(["turbo", "style"], [1.0, 0.6])`` per request; with ``fuse_lora``
every such switch re-merges in anonymous memory. Here the names map to the adapter
files, and each combination of names and weights is a cached combination (re-pointed
at mapped files) or served at run time while it is built (see
:mod:`lora_cache.switching.adapter_switch`).
"""

from __future__ import annotations

import os

from hostmem.errors import InputError
from .adapter_switch import SwitchResult, set_adapters
from ..adapters import AdapterError
from ..diffusers_entry import _model_of, _specs

__all__ = ["set_pipeline_adapters"]


def _weights(names: list[str], adapter_weights) -> list[float]:
    """One float per name, as diffusers takes them (None: 1.0 each; one number: for all)."""
    if adapter_weights is None:
        return [1.0] * len(names)
    if isinstance(adapter_weights, (int, float)):
        return [float(adapter_weights)] * len(names)
    weights = list(adapter_weights)
    if len(weights) != len(names):
        raise InputError(f"set_pipeline_adapters: {len(names)} adapter name(s) but {len(weights)} weight(s); "
                         "give one weight per name")
    bad = [w for w in weights if not isinstance(w, (int, float))]
    if bad:
        raise InputError(f"set_pipeline_adapters: weight {bad[0]!r} is not a number; per-component or per-block "
                         "weights (dicts) are not supported, give one number per adapter")
    return [float(w) for w in weights]


def set_pipeline_adapters(pipe_or_model, adapter_names, adapter_weights=None, *, files: dict,
                          cache_root: str | os.PathLike, weight_name: str | None = None, **options) -> SwitchResult:
    """Switch a diffusers pipeline (or model) to ``adapter_names`` at ``adapter_weights``.

    ``files`` maps each name to what ``load_lora_weights`` would take (a file, or a folder
    with ``weight_name``); ``[]`` switches to the base. ``options`` go to
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
    return set_adapters(_model_of(pipe_or_model), specs, cache_root, **options)
