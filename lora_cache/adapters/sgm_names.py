"""A diffusers UNet's modules in the original (LDM/SGM) layout's names, as key rules.

Trainers on the original SD 1.x, 2.x and SDXL checkpoints (kohya's sd-scripts for SDXL,
LyCORIS through it) name a module by the original UNet's layout: kohya as
``lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_k`` or
``lora_unet_output_blocks_2_0_out_layers_3``, ComfyUI as
``diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_k``. diffusers' converter
maps such a plain LoRA by the UNet's config (``unet_config``); a LyCORIS file (LoHa, LoKr,
a Tucker LoCon, ``dora_scale``, full diffs) is not given to it, and ComfyUI, whose UNet
keeps the original names, merges those too. Here the same layout is written from the
UNet's config as key rules for this package's reader: block by block as diffusers'
single-file loader lays a checkpoint out (``convert_ldm_unet_checkpoint``, which the tests
hold every rule to), a resnet's inner names renamed (``in_layers.2`` is ``conv1``), a
transformer's kept (they are diffusers' own).

Only the block types whose layout is known are described (``DownBlock2D``,
``CrossAttnDownBlock2D``, their up twins, ``UNetMidBlock2DCrossAttn``); any other UNet gets
no rules, and a key in those names is refused, naming it, as before.
"""

from __future__ import annotations

import re

__all__ = ["model_rules", "sgm_rules"]

_DOWN = {"DownBlock2D": False, "CrossAttnDownBlock2D": True}  # block type -> has attentions
_UP = {"UpBlock2D": False, "CrossAttnUpBlock2D": True}
_MIDDLE = {"UNetMidBlock2DCrossAttn", None}
_RESNET = {"in_layers.0": "norm1", "in_layers.2": "conv1", "emb_layers.1": "time_emb_proj",
           "out_layers.0": "norm2", "out_layers.3": "conv2", "skip_connection": "conv_shortcut"}
_OUTSIDE = {"input_blocks.0.0": "conv_in", "time_embed.0": "time_embedding.linear_1",
            "time_embed.2": "time_embedding.linear_2", "out.0": "conv_norm_out", "out.2": "conv_out"}


def _per_block(value, count: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * count


def layout(config) -> list[tuple[str, str, str]] | None:
    """``(original name, diffusers name, part)`` of every block part of a UNet with ``config``
    (``part``: ``resnet``, ``attention`` or ``module``), or None where a block type's layout
    is not one described here."""
    down, up = list(config.get("down_block_types") or ()), list(config.get("up_block_types") or ())
    middle = config.get("mid_block_type", "UNetMidBlock2DCrossAttn")
    if not down or len(up) != len(down) or any(t not in _DOWN for t in down) or any(t not in _UP for t in up) \
            or middle not in _MIDDLE:
        return None
    layers = _per_block(config.get("layers_per_block", 2), len(down))
    parts, k = [], 1
    for b, kind in enumerate(down):
        for n in range(layers[b]):
            parts.append((f"input_blocks.{k}.0", f"down_blocks.{b}.resnets.{n}", "resnet"))
            if _DOWN[kind]:
                parts.append((f"input_blocks.{k}.1", f"down_blocks.{b}.attentions.{n}", "attention"))
            k += 1
        if b < len(down) - 1:
            parts.append((f"input_blocks.{k}.0.op", f"down_blocks.{b}.downsamplers.0.conv", "module"))
            k += 1
    if middle is not None:
        parts += [("middle_block.0", "mid_block.resnets.0", "resnet"),
                  ("middle_block.1", "mid_block.attentions.0", "attention"),
                  ("middle_block.2", "mid_block.resnets.1", "resnet")]
    k = 0
    for b, (kind, count) in enumerate(zip(up, reversed(layers))):
        for n in range(count + 1):
            parts.append((f"output_blocks.{k}.0", f"up_blocks.{b}.resnets.{n}", "resnet"))
            if _UP[kind]:
                parts.append((f"output_blocks.{k}.1", f"up_blocks.{b}.attentions.{n}", "attention"))
            if b < len(up) - 1 and n == count:
                parts.append((f"output_blocks.{k}.{2 if _UP[kind] else 1}.conv", f"up_blocks.{b}.upsamplers.0.conv",
                              "module"))
            k += 1
    return parts


def _outside(config) -> dict[str, str]:
    """The modules outside the blocks: SDXL's ``label_emb`` is its ``add_embedding``, a class
    embedding's (SD 2.x's upscaler) its ``class_embedding``."""
    found = dict(_OUTSIDE)
    extra = ("add_embedding" if config.get("addition_embed_type") == "text_time" else
             "class_embedding" if config.get("class_embed_type") in ("timestep", "projection") else None)
    if extra is not None:
        found |= {"label_emb.0.0": f"{extra}.linear_1", "label_emb.0.2": f"{extra}.linear_2"}
    return found


def _spellings(original: str, inner: str = "") -> tuple[str, str]:
    """kohya's and ComfyUI's regexes of one original name (``inner``: a regex group after it)."""
    kohya = "^lora_unet_" + re.escape(original.replace(".", "_")) + ("_" + inner if inner else "") + "$"
    comfy = r"^(?:model\.)?diffusion_model\." + re.escape(original) + (r"\." + inner if inner else "") + "$"
    return kohya, comfy


def sgm_rules(config) -> tuple:
    """The key rules, ``(regex on a stem, target)``, of a UNet with ``config`` in the original
    names, both spellings; empty where :func:`layout` does not describe the UNet."""
    parts = layout(config)
    if parts is None:
        return ()
    rules = []
    for original, name, part in parts:
        if part == "attention":  # a transformer's inner names are diffusers' own
            kohya, comfy = _spellings(original, "(.+)")
            rules += [(kohya, "lora_unet_" + name.replace(".", "_") + r"_\1"), (comfy, name + r".\1")]
        elif part == "resnet":
            for inner, renamed in _RESNET.items():
                rules += [(pattern, f"{name}.{renamed}") for pattern in _spellings(f"{original}.{inner}")]
        else:
            rules += [(pattern, name) for pattern in _spellings(original)]
    for original, name in _outside(config).items():
        rules += [(pattern, name) for pattern in _spellings(original)]
    return tuple(rules)


def model_rules(model) -> tuple:
    """:func:`sgm_rules` of ``model`` where it is a diffusers ``UNet2DConditionModel`` (by its
    class's name: the CLI's checkpoint tree takes the name its config.json gives), else empty:
    another UNet (ControlNet-XS's) names its modules otherwise."""
    if type(model).__name__ != "UNet2DConditionModel":
        return ()
    config = getattr(model, "config", None)
    return sgm_rules(config) if hasattr(config, "get") else ()
