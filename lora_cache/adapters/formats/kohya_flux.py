"""kohya sd-scripts Flux adapters (BFL module names) read by this package's own parser, for
a diffusers Flux model whose sizes diffusers' converter cannot take.

diffusers' ``_convert_kohya_flux_lora_to_diffusers`` splits a single block's ``linear1``
(fused q, k, v and the MLP's input) at Flux-dev's widths (3072, 3072, 3072, 12288), and
converts double blocks 0-18 and single blocks 0-37 only: any other width or depth fails
there. :data:`RULES` name the modules its converter names; a LoRA on a fused projection
(``img_attn_qkv``, ``txt_attn_qkv``, ``linear1``) has its up matrix's rows split over the
model's own weights, in order, each as wide as the weight is (:mod:`lora_cache.targets.keys`), so
any width and depth works. Alphas come from ``.alpha`` (else alpha = rank) by the
precedence of :mod:`lora_cache.adapters.alpha`. Where both work the merge is diffusers'
up to one rounding: diffusers folds alpha / rank into the down matrix in the adapter's
dtype (and, for an up matrix that is block-diagonal over the split, keeps only its
blocks, which is the same product), where this merge applies alpha / rank in the fp32 sum.

One difference is on purpose: diffusers' converter drops the ``.alpha`` of the
``final_layer_*`` modules (merging them at scale 1); here they count as every other
module's alpha does, as kohya trained them.

``final_layer_adaLN_modulation_1`` lands on ``norm_out.linear`` with the halves of its up
matrix swapped, as diffusers' converter swaps them: BFL's final modulation gives shift
then scale, diffusers' ``AdaLayerNormContinuous`` scale then shift. The rule names the two
halves of the weight's rows in the up matrix's order (``norm_out.linear[1/2]``, then
``[0/2]``), so it holds at any width.

The table is BFL's module names, written once: :data:`RULES` spell them as kohya does
(``lora_unet_double_blocks_0_img_attn_qkv``), :data:`BFL_RULES` as ComfyUI keys a BFL
checkpoint (``diffusion_model.double_blocks.0.img_attn.qkv``, the qk norms by their whole
parameter name ``...img_attn.norm.query_norm.scale``), for the full diffs of a ComfyUI
Flux file (:mod:`lora_cache.adapters.diff_placement`), split by rows as the factors are.
"""

from __future__ import annotations

import functools
import re


__all__ = ["BFL_RULES", "CONVERTER", "NAME", "ROLES", "RULES", "claims", "read", "read_kohya_flux", "uncovered_stems"]

NAME = "kohya-flux"
ROLES: tuple = ()  # kohya's (:mod:`.kohya`)

# In the cache key: change when the rules would change a merge (a rule for a module that
# no rule named before changes none: a file with it was refused).
CONVERTER = "lora_cache kohya-flux-bfl v1"

# BFL's module names (its checkpoint's, without ``.weight``) -> diffusers' modules. kohya
# writes them with ``_`` for ``.`` (``lora_unet_double_blocks_0_img_attn_qkv``), ComfyUI as
# they are (``diffusion_model.double_blocks.0.img_attn.qkv``): both rule sets come from here.
_DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "img_attn.proj": "attn.to_out.0",
    "img_mlp.0": "ff.net.0.proj",
    "img_mlp.2": "ff.net.2",
    "img_mod.lin": "norm1.linear",
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "txt_attn.proj": "attn.to_add_out",
    "txt_mlp.0": "ff_context.net.0.proj",
    "txt_mlp.2": "ff_context.net.2",
    "txt_mod.lin": "norm1_context.linear",
}
_SINGLE = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "linear2": "proj_out",
    "modulation.lin": "norm.linear",
}
_OUTSIDE_BLOCKS = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": ("norm_out.linear[1/2]", "norm_out.linear[0/2]"),  # shift, scale -> swapped
}
# The qk norms' scales: vectors no LoRA trains, but a full diff may change (ComfyUI names a
# parameter that does not end in ``.weight`` by its whole name: ``...query_norm.scale``).
_DOUBLE_NORMS = {
    "img_attn.norm.query_norm.scale": "attn.norm_q",
    "img_attn.norm.key_norm.scale": "attn.norm_k",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k",
}
_SINGLE_NORMS = {"norm.query_norm.scale": "attn.norm_q", "norm.key_norm.scale": "attn.norm_k"}


def _rule(pattern: str, block: str, modules) -> tuple[str, str | list[str]]:
    if isinstance(modules, str):
        return pattern, f"{block}{modules}"
    return pattern, [f"{block}{m}" for m in modules]


def _rules(double: dict, single: dict, outside: dict, spell) -> tuple:
    """The rules over one spelling: ``spell(where, bfl)`` is the regex of a stem naming BFL
    module ``bfl`` in ``where`` (``double_blocks``, ``single_blocks`` or ``""``)."""
    return (
        *(_rule(spell("double_blocks", bfl), r"transformer_blocks.\1.", m) for bfl, m in double.items()),
        *(_rule(spell("single_blocks", bfl), r"single_transformer_blocks.\1.", m) for bfl, m in single.items()),
        *(_rule(spell("", bfl), "", m) for bfl, m in outside.items()),
    )


def _kohya(where: str, bfl: str) -> str:
    name = bfl.replace(".", "_")
    return rf"^lora_unet_{where}_(\d+)_{name}$" if where else rf"^lora_unet_{name}$"


def _comfyui(where: str, bfl: str) -> str:
    name = re.escape(bfl)
    return rf"^(?:model\.)?diffusion_model\.{where}\.(\d+)\.{name}$" if where else \
        rf"^(?:model\.)?diffusion_model\.{name}$"


@functools.cache
def _tables() -> dict[str, tuple]:
    """``RULES``, kohya's spelling, and ``BFL_RULES``: ComfyUI's keys of a BFL Flux checkpoint
    (``diffusion_model.`` and the BFL name), norms' scales included, the rules its full diffs
    are placed by (:mod:`lora_cache.adapters.diff_placement`). Built on first use: a plan lists
    the formats' suffixes without them."""
    return {"RULES": _rules(_DOUBLE, _SINGLE, _OUTSIDE_BLOCKS, _kohya),
            "BFL_RULES": _rules(_DOUBLE | _DOUBLE_NORMS, _SINGLE | _SINGLE_NORMS, _OUTSIDE_BLOCKS, _comfyui)}


def __getattr__(name: str):
    if name in ("RULES", "BFL_RULES"):
        return _tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def uncovered_stems(stems) -> list[str] | None:
    """The key stems (keys without their part's suffix) :data:`RULES` do not name, or None
    when the file is no kohya BFL Flux adapter at all (no ``lora_unet_double_blocks_`` /
    ``lora_unet_single_blocks_`` stem)."""
    stems = set(stems)
    if not any(s.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for s in stems):
        return None
    return sorted(s for s in stems if not any(re.match(p, s) for p, _ in _tables()["RULES"]))


def claims(keys, metadata: dict) -> bool:
    """A kohya BFL Flux file: taken by this module only where diffusers' converter refuses it
    (:mod:`lora_cache.adapters.diffusers_format`); read natively it is :mod:`.kohya`'s."""
    return uncovered_stems(key.rpartition(".lora_")[0] or key.removesuffix(".alpha") for key in keys) == []


def read(reading, why: str = "read with lora_cache's kohya Flux rules"):
    """The adapter read by this package's parser with :data:`RULES`, saying so (and ``why``)
    in one info line. Its tensors stay views of the file's read-only mapping."""
    import logging  # only when this fallback runs: the planner reads these rules without it

    logging.getLogger("lora_cache").info("%s: %s; reading its kohya Flux (BFL) names with lora_cache's own parser instead, fused qkv and "
              "linear1 split by rows at the model's own sizes", reading.path, why)
    from ..checks import FiniteCheck  # torch: only once a file is read; the suffixes above are read without it

    return reading.build(converter=CONVERTER, values_check=FiniteCheck(reading.path, reading.tensors),
                         rules=_tables()["RULES"])

