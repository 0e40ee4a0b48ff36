"""Key rules for adapters written in a family's original checkpoint names, read by this
package's reader where diffusers' converter cannot take the file.

Trainers that work on the original checkpoints name a module as that checkpoint does:
musubi-tuner and kohya as ``lora_unet_<name with _ for .>`` (``lora_unet_blocks_0_self_attn_q``,
``lora_unet_double_blocks_0_img_attn_qkv``), ComfyUI as ``diffusion_model.<name>``
(``diffusion_model.blocks.0.self_attn.q``). diffusers' converters read such files only in
the shapes they were written for: Wan's musubi converter needs every module and every
``.alpha`` of Flux-sized blocks (a file with some modules, or without ``.alpha``, is a
KeyError there), HunyuanVideo's chunks the ``.alpha`` scalars with the factors ("chunk
expects at least a 1-dimensional tensor") and splits ``linear1`` at HunyuanVideo's own
width (3072), and Flux's passes ai-toolkit's BFL names with peft's factors through
unconverted (diffusers then loads nothing of them). Flux.2's converters take a LoKr in BFL
names but no LoHa or Tucker core there, drop kohya's final modulation, and put ai-toolkit's
onto ``norm_out.linear`` with its halves unswapped, where the checkpoint's own converter
swaps them (BFL's shift, scale; diffusers' scale, shift). ComfyUI merges all of these.

So each family's original names are written once here, as kohya's Flux names are
(:mod:`lora_cache.adapters.formats.kohya_flux`), and spelt both ways. Where diffusers'
converter refuses a file, breaks it (factors that no longer multiply) or names modules
the model lacks, and the file uses the family's original names, the file is read by this
package's reader with the family's rules (:mod:`lora_cache.adapters.diffusers_format`).
Every module merges as ComfyUI merges it: ``alpha / rank * up @ down`` (alpha = rank
without ``.alpha``), a fused projection's up rows split over diffusers' weights in order
(``qkv`` over ``to_q``, ``to_k``, ``to_v``; ``linear1`` over those and ``proj_mlp``).
Stems the rules do not name are resolved like any other key (a file mixing diffusers'
names with the family's original ones), and those that name no module are refused with
the key named.
"""

from __future__ import annotations

import functools
import re
from typing import NamedTuple

__all__ = ["Family", "family_of", "rules_of", "uses_original_names"]

_WAN_BLOCK = {
    **{f"self_attn.{o}": f"attn1.{c}" for o, c in zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0"))},
    **{f"cross_attn.{o}": f"attn2.{c}" for o, c in zip("qkvo", ("to_q", "to_k", "to_v", "to_out.0"))},
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
}
_WAN_OUTSIDE = {
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "head.head": "proj_out",
    "patch_embedding": "patch_embedding",
}
_HUNYUAN_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn_proj": "attn.to_out.0",
    "img_mlp.fc1": "ff.net.0.proj",
    "img_mlp.fc2": "ff.net.2",
    "img_mod.linear": "norm1.linear",
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn_proj": "attn.to_add_out",
    "txt_mlp.fc1": "ff_context.net.0.proj",
    "txt_mlp.fc2": "ff_context.net.2",
    "txt_mod.linear": "norm1_context.linear",
}
_HUNYUAN_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": "proj_out",
    "modulation.linear": "norm.linear",
}
_HUNYUAN_OUTSIDE = {
    "img_in.proj": "x_embedder.proj",
    "time_in.mlp.0": "time_text_embed.timestep_embedder.linear_1",
    "time_in.mlp.2": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.mlp.0": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.mlp.2": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),  # shift, scale -> swapped
}
_FLUX2_DOUBLE = {  # diffusers' single-file converter for Flux.2 (BFL's names)
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": "attn.to_out.0",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": "attn.to_add_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
_FLUX2_SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}  # fused in both layouts
_FLUX2_OUTSIDE = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),  # shift, scale -> swapped
}


class Family(NamedTuple):
    """One family's original names: ``blocks`` (the block lists' names -> their diffusers
    list and module table) and the modules outside them, ``converter`` the name the cache
    key carries (change it when a rule would change a merge)."""

    name: str
    converter: str
    blocks: tuple  # ((original list, diffusers list, {module: target(s)}), ...)
    outside: dict
    rules: tuple = ()  # rules made from the model itself (a UNet's config), in place of the tables'


def _flux() -> Family:
    from .formats import kohya_flux as flux

    return Family("Flux", flux.CONVERTER, (("double_blocks", "transformer_blocks", flux._DOUBLE),
                                           ("single_blocks", "single_transformer_blocks", flux._SINGLE)),
                  flux._OUTSIDE_BLOCKS)


_FAMILIES = {  # the loader mixin diffusers converts the family's files with -> its original names
    "WanLoraLoaderMixin": lambda: Family("Wan", "lora_cache wan-original-names v1",
                                         (("blocks", "blocks", _WAN_BLOCK),), _WAN_OUTSIDE),
    "HunyuanVideoLoraLoaderMixin": lambda: Family(
        "HunyuanVideo", "lora_cache hunyuanvideo-original-names v1",
        (("double_blocks", "transformer_blocks", _HUNYUAN_DOUBLE), ("single_blocks", "single_transformer_blocks",
                                                                    _HUNYUAN_SINGLE)), _HUNYUAN_OUTSIDE),
    "FluxLoraLoaderMixin": _flux,
    "Flux2LoraLoaderMixin": lambda: Family(
        "Flux2", "lora_cache flux2-original-names v1",
        (("double_blocks", "transformer_blocks", _FLUX2_DOUBLE), ("single_blocks", "single_transformer_blocks",
                                                                  _FLUX2_SINGLE)), _FLUX2_OUTSIDE),
}


def _target(block: str, modules):
    return f"{block}{modules}" if isinstance(modules, str) else [f"{block}{m}" for m in modules]


def _spellings(where: str, name: str) -> tuple[str, str]:
    """kohya's (``lora_unet_blocks_(N)_self_attn_q``) and ComfyUI's
    (``diffusion_model.blocks.(N).self_attn.q``) regexes of one original module name."""
    kohya = name.replace(".", "_")
    comfy = re.escape(name)
    if not where:
        return rf"^lora_unet_{kohya}$", rf"^(?:model\.)?diffusion_model\.{comfy}$"
    return rf"^lora_unet_{where}_(\d+)_{kohya}$", rf"^(?:model\.)?diffusion_model\.{where}\.(\d+)\.{comfy}$"


def rules_of(family: Family) -> tuple:
    """The family's key rules, both spellings: ``(regex on a stem, target or [targets])``."""
    return family.rules or _rules(family.name)


@functools.cache
def _rules(name: str) -> tuple:
    family = next(make() for make in _FAMILIES.values() if make().name == name)
    rules = []
    for where, block, table in family.blocks:
        for name, modules in table.items():
            rules += [(pattern, _target(rf"{block}.\1.", modules)) for pattern in _spellings(where, name)]
    for name, modules in family.outside.items():
        rules += [(pattern, _target("", modules)) for pattern in _spellings("", name)]
    return tuple(rules)


_UNET_LOADERS = {"StableDiffusionLoraLoaderMixin", "StableDiffusionXLLoraLoaderMixin"}


def family_of(loader, model=None) -> Family | None:
    """The family whose files ``loader`` (a loader mixin or a pipeline class) converts, or None.

    With ``model`` a ``UNet2DConditionModel``, an SD 1.x, 2.x or SDXL UNet's loader gives the
    original (SGM) layout's names of that UNet (:mod:`lora_cache.adapters.sgm_names`), made
    from its config."""
    for base in getattr(loader, "__mro__", ()):
        make = _FAMILIES.get(base.__name__)
        if make is not None:
            return make()
        if base.__name__ in _UNET_LOADERS and model is not None:
            return _unet(model)
    return None


def _unet(model) -> Family | None:
    from .sgm_names import model_rules

    rules = model_rules(model)
    return Family("SGM UNet", "lora_cache sgm-unet-names v1", (), {}, rules) if rules else None


def uses_original_names(family: Family, stems) -> bool:
    """Whether any of ``stems`` (keys without their part's suffix) is in the family's original names."""
    pattern = _any_of(tuple(p for p, _ in rules_of(family)))
    return any(pattern.match(stem) for stem in stems)


@functools.cache
def _any_of(patterns: tuple[str, ...]) -> re.Pattern:
    """One regex of all ``patterns`` (a UNet's hundreds of rules, tried one by one on each of a
    file's stems, took 24 ms for 300 stems that none names; this, 2 ms)."""
    return re.compile("|".join(f"(?:{p})" for p in patterns))
