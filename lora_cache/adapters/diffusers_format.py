"""Adapter files read through diffusers' own converters, for diffusers models.

diffusers turns every layout its loaders accept (kohya sd-scripts with the BFL/Flux
names, ComfyUI and lightx2v, xlabs, its own) into its own keys with the pipeline class's
``lora_state_dict``; re-implementing those converters here would drift from them. So for
a diffusers model the file is read and checked here (every key, the alphas of the
header; its values when they are first consumed, as for any file), handed to that
classmethod as a dict, and what comes back is grouped like any other file. Alphas are
held to one meaning on this path too (:mod:`lora_cache.adapters.alpha_fold`): the
converters of kohya, ComfyUI and lightx2v layouts fold each module's ``.alpha`` into its
matrices (scale 1 afterwards), so before they run every module gets its alpha (a
header's ``alpha``, or ``Adapter(alpha=...)`` in place of the
stored ones), and what was folded is never applied again. The converters
get copies of the tensors (some scale them in place, which a read-only mapping refuses
with a SIGSEGV): as much anonymous memory as the adapter, as diffusers' own loader
takes. So each conversion is recorded by the file's content
(:mod:`lora_cache.adapters.conversion_memo`), and a start that finds the record plans
from it without converting: a start whose every layer is cached reads and copies no
value of the adapter. Where diffusers' kohya Flux converter cannot take the model's
sizes (it hard-codes Flux-dev's), or where the file has LoRA factors on Flux's final
layer (the converter drops their alphas and names them outside the transformer), the file
is read by this package's own parser (:mod:`lora_cache.adapters.formats.kohya_flux`). diffusers is an optional extra: nothing here
imports it unless a model is a diffusers model.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys

import torch

from .accounting import dropped_bias_diffs, dropped_by_converter, dropped_dora_scales, left_over
from .alpha_fold import folded_metadata, for_converter, is_folded
from .checks import FiniteCheck, widened
from .conversion_memo import ConversionMemo, NoValues, record_of, skeleton_of
from .diffusers_keys import peft_keys
from .diff_placement import diff_placer, full_diff_stems, place_full_diffs, without_full_diffs
from .family_rules import family_of, rules_of, uses_original_names
from .formats import split_key
from .read import AdapterFile, build_adapter_file, group_parts, open_adapter, reading_of
from .spec import AdapterError

__all__ = ["diffusers_loader", "is_diffusers_model", "read_with_diffusers", "read_with_family_rules"]

# Model class -> the pipeline loader mixin whose lora_state_dict converts for it, where
# diffusers' docstrings do not say it alone (see _discovered).
_LOADERS = {
    "UNet2DConditionModel": "StableDiffusionXLLoraLoaderMixin",  # SD's and SDXL's docstrings both name it
    "WanTransformer3DModel": "WanLoraLoaderMixin",  # CogView4's docstring names it too
    "CogView4Transformer2DModel": "CogView4LoraLoaderMixin",
}


def is_diffusers_model(module) -> bool:
    """Whether ``module`` is a diffusers model (never imports diffusers to find out)."""
    diffusers = sys.modules.get("diffusers")
    return diffusers is not None and isinstance(module, diffusers.ModelMixin)


_SGM = re.compile(r"(?:^| )lora_unet_(?:input_blocks|middle_block|output_blocks)_")  # kohya SDXL's SGM names
_INTO = re.compile(r"Load LoRA layers into \[`(\w+)`\]")


@functools.cache
def _discovered() -> dict[str, str]:
    """Model class -> loader mixin, from diffusers' own mixins: each one's docstring opens
    with the model it loads into (``Load LoRA layers into [`ZImageTransformer2DModel`]``),
    so a family diffusers adds is found without a list here. A model two mixins name
    (a docstring copied from another family's) is left to :data:`_LOADERS`."""
    from diffusers.loaders import lora_pipeline

    named: dict[str, set[str]] = {}
    for name, mixin in vars(lora_pipeline).items():
        if name.endswith("LoraLoaderMixin") and isinstance(mixin, type) and hasattr(mixin, "lora_state_dict"):
            found = _INTO.search(mixin.__doc__ or "")
            if found:
                named.setdefault(found.group(1), set()).add(name)
    return {model: next(iter(names)) for model, names in named.items() if len(names) == 1}


def diffusers_loader(module):
    """The loader mixin class that converts adapters for ``module``'s class, or None: the
    list above where it names the class, else the mixin diffusers' docstrings name for it."""
    model = type(module).__name__
    name = _LOADERS.get(model) or _discovered().get(model)
    if name is None:
        return None
    from diffusers.loaders import lora_pipeline

    return getattr(lora_pipeline, name, None)


def denoiser_name(loader) -> str:
    """The pipeline component the loader's denoiser is (``transformer``, ``unet``)."""
    return getattr(loader, "transformer_name", None) or getattr(loader, "unet_name", None) or "transformer"


class ConversionRefused(AdapterError):
    """diffusers' converter could not convert a file; ``reason`` is its own word."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _convert(loader, path: str, tensors: dict, model=None) -> tuple[dict, dict]:
    """diffusers' conversion: ``(state dict in diffusers' keys, network alphas)``. A UNet's
    config is passed as ``load_lora_weights`` passes it (``unet_config=self.unet.config``):
    kohya SDXL files in SGM block names (``lora_unet_input_blocks_4_1_...``) are mapped
    to diffusers' blocks by it, and without it they name blocks the UNet lacks."""
    wants_alphas = "return_alphas" in inspect.signature(loader.lora_state_dict).parameters
    kwargs = {"return_alphas": True} if wants_alphas else {}
    if getattr(loader, "unet_name", None) and model is not None and hasattr(model, "config"):
        kwargs["unet_config"] = model.config
    try:
        out = loader.lora_state_dict(dict(tensors), **kwargs)
    except Exception as exc:  # diffusers' converters also fail by assert (sizes they hard-code)
        reason = str(exc) or type(exc).__name__
        raise ConversionRefused(
            f"{path}: diffusers' {loader.__name__}.lora_state_dict cannot convert it ({reason}); "
            "pass convert='native' with key rules to read it without diffusers", reason
        ) from None
    state, alphas = (out if isinstance(out, tuple) else (out, None))[:2]
    return state, dict(alphas or {})


def _unprefixed(state: dict, loader, keep: tuple[str, ...]) -> bool:
    """Whether no converted key names a component: a file of the model's own keys, as
    diffusers' ``save_lora_adapter`` writes (``blocks.0.attn1.to_q.lora_A.weight`` and its
    config unprefixed), which ``load_lora_adapter`` loads into the model it is called on."""
    components = {*getattr(loader, "_lora_loadable_modules", ()), *keep}
    return bool(state) and not any(key.split(".", 1)[0] in components for key in state)


def _kept(path: str, state: dict, keep: tuple[str, ...], loader=None) -> dict:
    """The converted keys of the components ``keep`` names (all of them, for a file of the
    model's own unprefixed keys)."""
    if loader is not None and _unprefixed(state, loader, keep):
        return dict(state)
    kept = {k: v for k, v in state.items() if k.split(".", 1)[0] in keep}
    if not kept:
        found = f"they start with {sorted({k.split('.', 1)[0] for k in state})}" if state else \
            "the converter drops every key of the file, and diffusers loads nothing of it"
        raise AdapterError(f"{path}: after diffusers' conversion no key belongs to {', '.join(keep)} ({found}); "
                           "is it an adapter for another model?")
    return kept


def _left(path: str, loader, state: dict, fed: dict, modules: dict, keep: tuple[str, ...],
          model=None) -> dict[str, list[str]]:
    """The keys a conversion leaves unused: ``dropped`` by the converter (the file's keys),
    ``others``: converted for a component not merged (see :mod:`lora_cache.adapters.accounting`)."""
    dropped = dropped_by_converter(lambda probe: _convert(loader, path, {k: widened(v) for k, v in probe.items()},
                                                          model)[0], fed, modules)
    dropped += dropped_dora_scales(fed, state)
    dropped += dropped_bias_diffs(fed, state)
    others = [] if _unprefixed(state, loader, keep) else sorted(key for key in state if key.split(".", 1)[0] not in keep)
    return {"dropped": dropped, "others": others}


def _say_left(path: str, loader, left: dict[str, list[str]], keep: tuple[str, ...], pipeline: bool,
              strict: bool) -> None:
    """Refuse (under ``strict``) or name the keys a conversion left unused. A pipeline lacking
    a component the file changes is refused; a model merged alone (a UNet taken out of its
    pipeline) is one component by the caller's choice, and the others' keys are named."""
    left_over(path, left["dropped"], f"are dropped by diffusers' {loader.__name__}.lora_state_dict (it merges "
              "nothing of them)", strict, "pass convert='native' (config: convert: native) to read the file with "
              "lora_cache's own reader, which merges every key it can place or names the ones it cannot")
    if left["others"]:
        named = ", ".join(sorted({_component_of(key) or key.split(".", 1)[0] for key in left["others"]}))
        where = "the pipeline lacks" if pipeline else "is not the model merged into"
        left_over(path, left["others"], f"change {named}, which {where} (it has {', '.join(keep)})", strict and pipeline)


def _converted(path: str, loader, tensors: dict, metadata: dict, keep: tuple[str, ...],
               converter: str, alpha: float | None, model=None, strict: bool = True,
               pipeline: bool = False) -> tuple[AdapterFile, dict]:
    """Convert with diffusers (or, where its kohya Flux converter refuses the sizes, read with
    this package's parser): ``(the adapter, its conversion record)``. ``alpha``: the
    override, given to the converter in place of the stored alphas it folds; ``model``:
    the denoiser, whose single-file converter names the file's full diffs; ``strict``:
    keys left unused are an error, else a warning; ``pipeline``: ``keep`` are the
    components of a pipeline (which then lacks the others), not one model merged alone."""
    modules = group_parts(path, tensors)  # the file's own keys and shapes, checked before any conversion
    values_check = FiniteCheck(path, tensors)  # the file's own values, under the file's own keys
    stems = full_diff_stems(modules, model)  # taken out: diffusers' LoRA converters drop them
    diffs = place_full_diffs(path, modules, stems, model, denoiser_name(loader))
    fed = for_converter(path, without_full_diffs(tensors, modules, stems, model), modules, metadata, alpha)
    # diffusers' converters scale some matrices in place (Wan's: ``*=``): they get writable
    # copies, never views of the read-only mapping (a write there is a SIGSEGV).
    # Narrow floats (fp8) are widened first: torch's CPU kernels cannot scale them (diffusers' own
    # loader fails there on a CPU), and the values are the same.
    writable = {k: widened(v).clone() for k, v in fed.items()}
    family = family_of(loader, model)
    original = family is not None and uses_original_names(family, modules)
    own = model is not None and _kohya_spelt_own_names(modules)
    try:
        state, alphas = _convert(loader, path, writable, model) if writable else ({}, {})
        del writable
        left = _left(path, loader, state, fed, modules, keep, model)
        kept = _kept(path, {**state, **diffs}, keep, loader)  # the merge's components only: another's keys are named
        kept = peft_keys(path, kept, {k: v for k, v in alphas.items() if k.split(".", 1)[0] in keep})
        kept = _diffs_kept_diffs(fed, kept)
        if original or own:  # what the converter made of these names must be the model's weights
            _check_converted(path, loader, kept, model)
    except AdapterError as failed:  # ConversionRefused included
        if not (original or own):
            raise
        why = f"diffusers' {loader.__name__}.lora_state_dict cannot convert it ({getattr(failed, 'reason', failed)})"
        adapter = read_with_family_rules(path, _diffs_placed(path, tensors, model, loader, family), metadata,
                                         family, why, loader, keep, pipeline, strict)
        return adapter, record_of("family-rules", adapter.converter)
    _say_left(path, loader, left, keep, pipeline, strict)
    folded = is_folded(fed, kept)
    adapter = build_adapter_file(path, kept, folded_metadata(metadata, folded), converter=converter,
                                 values_check=values_check, folded=folded)
    return adapter, record_of("diffusers", converter, kept, folded, left)


def _diffs_kept_diffs(fed: dict, kept: dict) -> dict:
    """``kept`` with the ``lora_B.bias`` a converter made of the file's ``diff_b`` named a
    ``diff_b`` again.

    diffusers' Wan converter turns a ``diff_b`` beside a module's factors into peft's
    ``lora_B.bias``, which peft scales by alpha / rank as it scales ``B @ A``; the
    converter folds a stored alpha into the factors, so that the bias is added as the file
    gives it, as ComfyUI adds it. An alpha given outside the file (``Adapter(alpha=)``, the
    header's) is not folded, and would scale the bias too (2x at alpha 16 on rank 8). A
    file that has no ``lora_B.bias`` of its own and has ``diff_b`` gets every bias the
    converter made back as a difference: added at the adapter's strength alone.
    """
    if any(key.endswith("lora_B.bias") for key in fed) or not any(key.endswith(".diff_b") for key in fed):
        return kept
    return {(key.removesuffix("lora_B.bias") + "diff_b" if key.endswith(".lora_B.bias") else key): value
            for key, value in kept.items()}


_LAYOUTS = {"kohya": ("lora_unet_", "lora_te", "lora_transformer_"),
            "ComfyUI": ("diffusion_model.", "model.diffusion_model."),
            "diffusers": ("transformer.", "unet.", "text_encoder.", "text_encoder_2.")}


def _mixed_layouts(tensors: dict) -> list[str]:
    """The layouts a file mixes (kohya's, ComfyUI's and diffusers' prefixes), when more than one."""
    found = [name for name, prefixes in _LAYOUTS.items() if any(key.startswith(prefixes) for key in tensors)]
    return found if len(found) > 1 else []


def _converter_breaks(tensors: dict, family) -> str:
    """Why diffusers' Flux or Flux.2 converter would merge this file other than ComfyUI, its
    format's reference, does ("" where it would not). Flux's kohya converter:

    - LoRA factors on the final layer (``lora_unet_final_layer_*``): the converter pops their
      ``.alpha`` without folding it and writes their keys without the ``transformer.``
      prefix, so a file of these alone was merged at scale 1 (16x at kohya's rank 16,
      alpha 1) and beside any block module they were left out;
    - a ``dora_scale``: the converter drops it (merged as plain LoRA, or refused).

    The family's rules merge both as ComfyUI does: ``alpha / rank``, the modulation's halves
    swapped, a row-axis DoRA scale split by rows over a fused projection. Flux.2's
    converters drop kohya's final modulation (``lora_unet_final_layer_adaLN_modulation_1``)
    and put ai-toolkit's onto ``norm_out.linear`` unswapped, each half on the other's rows."""
    if family is not None and family.name == "Flux2":
        return _flux2_broken(tensors)
    if family is None or family.name != "Flux":
        return ""
    final = sorted({key.split(".", 1)[0] for key in tensors if key.startswith("lora_unet_final_layer_")
                    and key.endswith(("lora_down.weight", "lora_up.weight"))})
    dora = sorted({key.split(".", 1)[0] for key in tensors if key.startswith("lora_unet_")
                   and key.endswith(".dora_scale")})
    why = []
    if final:
        why.append(f"drops the alphas of {', '.join(final)} and names them outside the transformer (merged at scale "
                   "1 alone, not at all beside blocks)")
    if dora:
        why.append(f"drops the DoRA scales of {len(dora)} module(s) ({', '.join(dora[:2])}"
                   f"{', ...' if len(dora) > 2 else ''})")
    return f"diffusers' converter {' and '.join(why)}" if why else ""


_FLUX2_FINAL = re.compile(r"^(?:lora_unet_final_layer_adaLN_modulation_1|(?:model\.)?diffusion_model\."
                          r"final_layer\.adaLN_modulation\.1)\.")


def _flux2_broken(tensors: dict) -> str:
    final = sorted({found.group(0)[:-1] for found in map(_FLUX2_FINAL.match, tensors) if found})
    return (f"diffusers' converter drops {', '.join(final)} or puts its halves unswapped on norm_out.linear "
            "(BFL's shift, scale; diffusers' scale, shift)" if final else "")


def _kohya_spelt_own_names(modules: dict) -> bool:
    """Whether the file names the model's own modules in kohya's spelling under the
    transformer's prefix (``lora_transformer_transformer_blocks_0_ff_net_0_proj``, as
    OneTrainer writes Flux): diffusers' Flux converter knows only the attention modules of
    a block, and names every other one the block itself, where they replace one another."""
    return any(stem.startswith("lora_transformer_") for stem in modules)


def _check_converted(path: str, loader, kept: dict, model) -> None:
    """The converted factors multiply and name modules of the denoiser that hold a weight,
    else an :class:`AdapterError` (diffusers' converters hard-code their family's widths,
    pass names they do not know through, and may name a block for a module in it)."""
    group_parts(path, kept)
    if model is None:
        return
    denoiser = denoiser_name(loader)
    names = {name for name, module in model.named_modules() if torch.is_tensor(getattr(module, "weight", None))}
    components = set(getattr(loader, "_lora_loadable_modules", ())) - {denoiser}
    for key in kept:
        stem, role = split_key(key) or (key.rpartition(".")[0], "")
        if role not in ("down", "up"):  # full diffs were placed by the single-file converter (full_diffs)
            continue
        first, _, rest = stem.partition(".")
        if first in components:
            continue
        if (rest if first == denoiser else stem) not in names:
            raise AdapterError(f"{path}: diffusers' conversion names {key!r}, which is no module of the model "
                               "that holds a weight")


_TEXT_ENCODERS = (("lora_te2_", "text_encoder_2"), ("lora_te1_", "text_encoder"), ("lora_te_", "text_encoder"),
                  ("text_encoder_2.", "text_encoder_2"), ("text_encoder.", "text_encoder"))


def _component_of(key: str) -> str | None:
    """The text encoder a file's key changes (kohya's ``lora_te1_``, diffusers' ``text_encoder.``),
    None for the denoiser's keys."""
    return next((name for prefix, name in _TEXT_ENCODERS if key.startswith(prefix)), None)


def read_with_family_rules(path: str, tensors: dict, metadata: dict, family, why: str, loader=None,
                            keep: tuple[str, ...] = (), pipeline: bool = False, strict: bool = True) -> AdapterFile:
    """The file read by this package's reader with the family's original names as key rules
    (:mod:`lora_cache.adapters.family_rules`), saying so and ``why`` in one info line. The
    keys of a text encoder ``keep`` does not name are held to the rule the converter's
    path holds them to (:func:`_say_left`: refused where a pipeline lacks it, named in a
    warning for a model merged alone), and left out of the reading."""
    import logging

    others = sorted(key for key in tensors if _component_of(key) not in (None, *keep)) if keep else []
    if others and loader is not None:
        _say_left(path, loader, {"dropped": [], "others": others}, keep, pipeline, strict)
        tensors = {key: value for key, value in tensors.items() if key not in set(others)}

    logging.getLogger("lora_cache").info("%s: %s; reading it with lora_cache's own parser instead%s", path, why,
                                         "" if family is None else f", {family.name}'s original names as key rules "
                                         "made from the model's own sizes")
    if family is None:
        return reading_of(path, tensors, metadata).build(values_check=FiniteCheck(path, tensors))
    return reading_of(path, tensors, metadata).build(converter=family.converter,
                                                     values_check=FiniteCheck(path, tensors), rules=rules_of(family))


def _diffs_placed(path: str, tensors: dict, model, loader, family) -> dict:
    """``tensors`` for a reading with ``family``'s rules: the full diffs of modules the rules do
    not name (Wan's ``norm3``, ``modulation``, the qk norms) under the model's names, as
    the converter's path places them (:mod:`lora_cache.adapters.diff_placement`)."""
    if family is None or model is None or not any(key.endswith((".diff", ".diff_b")) for key in tensors):
        return tensors
    modules = group_parts(path, tensors)
    stems = [stem for stem in full_diff_stems(modules, model) if not uses_original_names(family, [stem])]
    if not stems:
        return tensors
    placed = place_full_diffs(path, modules, stems, model, denoiser_name(loader))
    return {**without_full_diffs(tensors, modules, stems, model), **placed}


def _from_record(path: str, loader, tensors: dict, metadata: dict, record: dict, keep: tuple[str, ...],
                 pipeline: bool, strict: bool, model=None) -> AdapterFile:
    """The adapter as its conversion record describes it: diffusers' keys with tensors on the
    meta device (values are needed only where a layer is computed: :class:`NoValues`), or
    the file read by this package's kohya Flux parser (views of the file, as any read)."""
    if record["kind"] in ("family-rules", "kohya-flux"):
        return read_with_family_rules(path, _diffs_placed(path, tensors, model, loader, family_of(loader, model)),
                                      metadata, family_of(loader, model),
                                      "diffusers' converter could not convert it when first read", loader, keep,
                                      pipeline, strict)
    _say_left(path, loader, record["left"], keep, pipeline, strict)  # as when it was converted
    folded = bool(record.get("folded"))
    return build_adapter_file(path, skeleton_of(record), folded_metadata(metadata, folded),
                              converter=record["converter"], values_check=NoValues(path), folded=folded)


def read_with_diffusers(path, loader, components: tuple[str, ...] | None = None, memo: ConversionMemo | None = None,
                        *, alpha: float | None = None, model=None, strict: bool = True) -> AdapterFile:
    """Read ``path`` through ``loader.lora_state_dict``; keep the keys of ``components``.

    ``alpha`` is ``Adapter(alpha=...)``: where the converter folds alphas it folds this
    one instead of the file's. With ``memo``, a conversion of the same content by the
    same converter (and override) recorded there is planned from without converting; a
    new conversion is recorded there. ``model``: the denoiser the file goes into (its
    class's single-file converter names full diffs, :mod:`lora_cache.adapters.diff_placement`);
    ``strict``: keys the conversion leaves unused are an error, else one warning.
    """
    import diffusers

    path, mapped, tensors = open_adapter(path)
    metadata = mapped.metadata()
    keep = tuple(components or (denoiser_name(loader),))
    converter = f"diffusers {diffusers.__version__} {loader.__name__}.lora_state_dict"
    if any(key.endswith((".diff", ".diff_b")) for key in tensors):  # the merged bytes changed when these stopped dropping
        converter += f" + full diffs by {diff_placer(model)}"
    if _SGM.search(" ".join(tensors)) and getattr(model, "config", None) is not None:  # mapped by the UNet's
        converter += f" + SGM blocks at layers_per_block={model.config.get('layers_per_block')}"
    mixed = _mixed_layouts(tensors)
    if mixed:  # each converter takes its own layout and drops or breaks the other
        return read_with_family_rules(path, tensors, metadata, family_of(loader, model),
                                       f"it mixes {' and '.join(mixed)} keys, which no converter of diffusers reads",
                                       loader, keep, bool(components), strict)
    family = family_of(loader, model)
    broken = _converter_breaks(tensors, family)
    if broken:  # diffusers' converter breaks these: read every module with the family's rules
        return read_with_family_rules(path, _diffs_placed(path, tensors, model, loader, family), metadata, family,
                                      broken, loader, keep, bool(components), strict)
    name = memo.key(path, converter, keep, alpha) if memo is not None else None
    record = memo.load(name) if memo is not None else None
    if record is not None:
        return _from_record(path, loader, tensors, metadata, record, keep, bool(components), strict, model)
    adapter, record = _converted(path, loader, tensors, metadata, keep, converter, alpha, model, strict,
                                 pipeline=bool(components))
    if memo is not None:
        memo.store(name, record)
    return adapter
