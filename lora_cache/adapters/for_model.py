"""Reading the adapters of one merge for the model they go into.

A diffusers model (or the components ``lora_cache.load_lora`` took from a pipeline) gets
its adapters through diffusers' own converter; every other model through this package's
reader, as does a file of a format diffusers does not read (its module in
:mod:`lora_cache.adapters.formats` says ``DIFFUSERS_READS = False``), with the family's
original names as key rules where the file uses them (:mod:`lora_cache.adapters.family_rules`).
The choice is made here, once per merge, so the rest of the merge never asks.
"""

from __future__ import annotations

from hostmem.safetensors.header import SafetensorsError, read_header

from .conversion_memo import ConversionMemo
from .diffusers_format import (denoiser_name, diffusers_loader, is_diffusers_model, read_with_diffusers,
                               read_with_family_rules)
from .family_rules import family_of, uses_original_names
from .formats import detect, split_key
from .read import AdapterFile, open_adapter, peft_config_path, read_adapter, read_opened, resolve_file
from .spec import Adapter, AdapterError

__all__ = ["read_adapters"]


def _diffusers_parts(model) -> tuple[object, tuple[str, ...]] | None:
    """``(loader, component names)`` when ``model`` is a diffusers model (or a dict of them)."""
    if isinstance(model, dict):
        loaders = {n: diffusers_loader(m) for n, m in model.items() if is_diffusers_model(m)}
        found = {found for found in loaders.values() if found is not None}
        return (found.pop(), tuple(model)) if len(found) == 1 else None
    if is_diffusers_model(model):
        loader = diffusers_loader(model)
        return None if loader is None else (loader, ())
    return None


def _denoiser(model, loader):
    """The module the loader's denoiser component names (the model itself when it is one)."""
    if not isinstance(model, dict):
        return model
    return model.get(denoiser_name(loader))


def _diffusers_reads(path: str) -> bool:
    """Whether the file's format is one diffusers' converters read (a LyCORIS file's
    ``lycoris_`` names and ``dora_scale`` are not: lora_cache's reader takes it). Decided
    from the header's names alone; a file that cannot be read is left to the reader that
    says so."""
    try:
        header = read_header(path)
    except (SafetensorsError, OSError):
        return True
    return getattr(detect(header.tensors, header.metadata), "DIFFUSERS_READS", True)


def _read_here(path: str, spec: Adapter, found, denoiser=None) -> AdapterFile:
    """A file diffusers' converters are not given (a LyCORIS kind, a peft folder), read by this
    package's reader: with the family's original names as key rules where ``found`` (the
    loader and components) is a family's whose names the file uses
    (``lora_unet_double_blocks_0_img_attn_qkv.hada_w1_a``, ``diffusion_model.blocks.0.self_attn.q``),
    as diffusers' path reads such a file where its converter cannot; ``convert='native'``
    reads the names as they are."""
    family = family_of(found[0], denoiser) if found is not None and spec.convert == "auto" else None
    if family is None:
        return read_adapter(path, check_values=False)
    path, mapped, tensors = open_adapter(path)
    if uses_original_names(family, {split[0] for split in map(split_key, tensors) if split}):
        return read_with_family_rules(path, tensors, mapped.metadata(), family, "diffusers' converters are not "
                                      "given its format", found[0], found[1] or (denoiser_name(found[0]),),
                                      bool(found[1]), spec.strict)
    return read_opened(path, mapped, tensors, check_values=False)  # opened once


def read_adapters(model, specs: list[Adapter], loader=None, components: tuple[str, ...] = (),
                  memo_roots: list[str] | None = None) -> list[AdapterFile]:
    """Read every adapter for ``model``: through diffusers' converter where ``loader`` (a
    pipeline class or loader mixin) is given or ``model`` is a diffusers model and the
    spec allows it, else with this package's reader. A peft folder (adapter_config.json
    beside the file) is always read here: diffusers' loaders do not take it. The values
    are checked when they are first consumed, not here (a start that hits every layer in
    the cache never reads them).

    ``memo_roots`` (the cache roots of the merge) keep diffusers' conversions by content:
    an adapter converted before is then planned from its record, with no value read or
    copied, and its first use of values raises
    :class:`~lora_cache.adapters.conversion_memo.ValuesNeeded` (convert and plan again).
    """
    loader = loader or getattr(model, "lora_loader", None)  # lora_cache.load_lora's pipeline class
    if loader is not None and not components and isinstance(model, dict):
        components = tuple(model)
    found = (loader, components) if loader is not None else _diffusers_parts(model)
    files, memo = [], None
    for spec in specs:
        path = resolve_file(spec.path)
        peft_folder = peft_config_path(path) is not None
        use = spec.convert == "diffusers" or (spec.convert == "auto" and found is not None and not peft_folder
                                              and _diffusers_reads(path))
        if use and found is None:
            raise AdapterError(f"{spec.path}: convert='diffusers' but the model is not one diffusers loads LoRA into")
        if use and memo is None and memo_roots:
            memo = ConversionMemo(memo_roots)
        files.append(read_with_diffusers(path, found[0], found[1] or None, memo, alpha=spec.alpha,
                                         model=_denoiser(model, found[0]), strict=spec.strict)
                     if use else _read_here(path, spec, found, found and _denoiser(model, found[0])))
    return files
