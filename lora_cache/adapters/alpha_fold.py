"""Alphas handed to a converter that folds them into the factors, so that each is applied once.

diffusers' converters for kohya, ComfyUI and lightx2v layouts fold a module's ``.alpha``
into its matrices (``down * alpha / rank``) and drop the scalar; a module without one
is left at alpha = rank. An alpha stated elsewhere (a header's ``alpha``; never
``ss_network_alpha``, which no loader reads: :mod:`.alpha`) or asked for
(``Adapter(alpha=...)``) would then be applied after the fold, on top of it, or not at
all. So before the converter runs:

- two stored alphas of one module that disagree are the same error as on this
  package's own path (:class:`~lora_cache.adapters.alpha.AlphaSources`);
- with an override, every ``.alpha`` the converter gets is the override;
- every module without a ``.alpha`` gets the file's one alpha (the override, else the
  header's entry), where the converter takes ``.alpha`` keys: always beside kohya's
  ``lora_down``, beside ``lora_A`` only when the file already has ``.alpha`` keys (a
  layout the converter folds).

After it ran, :func:`is_folded` tells whether it folded them (it was given alphas and
gave none back); then no alpha applies afterwards (:attr:`AdapterFile.folded`), and
the header's entries, already in the factors, are dropped (:func:`folded_metadata`).
A converter that hands the alphas back instead (SD kohya's network alphas) folds
nothing, and they count as the module's ``.alpha``, the override replacing them.
"""

from __future__ import annotations

import torch

from .alpha import AlphaSources, diffusers_metadata, header_alpha

__all__ = ["folded_metadata", "for_converter", "is_folded"]

_HEADER_ALPHAS = ("alpha", "lora_alpha", "network_alpha")


def _sources(path: str, metadata: dict) -> AlphaSources:
    return AlphaSources(path, None, diffusers_metadata(path, metadata), header_alpha(path, metadata))


def _check_stored(sources: AlphaSources, modules: dict) -> None:
    """Two stored alphas of a module that disagree: an error naming both."""
    for change in modules.values():
        if "alpha" in change.parts:
            sources.alpha(change.stem, (change.keys["alpha"], change.stored_alpha))


def for_converter(path: str, tensors: dict, modules: dict, metadata: dict, override: float | None) -> dict:
    """The tensors to hand a converter: ``tensors`` with the alphas it folds made final
    (see the module docstring); ``modules`` are ``tensors`` grouped by stem."""
    sources = _sources(path, metadata)
    if override is None:
        _check_stored(sources, modules)
    header = sources.header
    file_wide = override if override is not None else (header[1] if header else None)
    if file_wide is None:
        return tensors
    has_alphas = any(key.endswith(".alpha") for key in tensors)
    fed = dict(tensors)
    for change in modules.values():
        down = change.keys.get("down")
        if down is None:
            continue
        if "alpha" in change.parts:
            if override is not None:
                fed[change.keys["alpha"]] = torch.tensor(float(override), dtype=torch.float32)
        elif down.endswith(".lora_down.weight") or has_alphas:
            fed[f"{change.stem}.alpha"] = torch.tensor(float(file_wide), dtype=torch.float32)
    return fed


def is_folded(fed: dict, converted: dict) -> bool:
    """Whether the converter folded the alphas it was given (it gave none back)."""
    given = any(key.endswith(".alpha") for key in fed)
    return given and not any(key.endswith(".alpha") for key in converted)


def folded_metadata(metadata: dict, folded: bool) -> dict:
    """The header as it applies after conversion: without its alphas when they were folded."""
    if not folded:
        return metadata
    return {key: value for key, value in metadata.items() if key not in _HEADER_ALPHAS}
