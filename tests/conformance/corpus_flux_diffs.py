"""The corpus's Flux files with full diffs under BFL names, as ComfyUI writes and merges them.

ComfyUI keys a BFL Flux checkpoint's weight by its name without ``.weight``
(``diffusion_model.double_blocks.0.img_attn.qkv``) and any other parameter by its whole
name (``...img_attn.norm.query_norm.scale``), and merges ``<key>.diff`` into that
parameter and ``<key>.diff_b`` into the bias beside it as ``W += strength * diff``
(``comfy/lora.py``). Its weights are BFL's fused ones; diffusers' are split, so the
expected change is written here by hand: a fused diff's rows cut in order onto the split
weights, the final modulation's halves swapped (BFL's shift, scale against diffusers'
scale, shift).

:func:`rows` gives each file as the keyword arguments of a
:class:`tests.conformance.corpus.Case`.
"""

from __future__ import annotations

import os

import torch

from hostmem.safetensors.mapping import save_file

_DIM, _MLP, _HEAD = 32, 128, 16  # tests.clients.tiny_models.FLUX: inner width, MLP width, head width
_P = "diffusion_model."
_SHAPES = {  # key -> shape, in ComfyUI's names
    f"{_P}double_blocks.0.img_attn.qkv.diff": (3 * _DIM, _DIM),
    f"{_P}double_blocks.0.img_attn.qkv.diff_b": (3 * _DIM,),
    f"{_P}double_blocks.0.img_attn.proj.diff": (_DIM, _DIM),
    f"{_P}double_blocks.0.img_attn.proj.diff_b": (_DIM,),  # beside factors: the bias's diff (Flux's converter drops it)
    f"{_P}double_blocks.0.img_attn.norm.query_norm.scale.diff": (_HEAD,),
    f"{_P}double_blocks.0.txt_attn.norm.key_norm.scale.diff": (_HEAD,),
    f"{_P}double_blocks.0.txt_mlp.0.diff_b": (_MLP,),
    f"{_P}single_blocks.0.linear1.diff": (3 * _DIM + _MLP, _DIM),
    f"{_P}single_blocks.0.linear1.diff_b": (3 * _DIM + _MLP,),
    f"{_P}single_blocks.0.norm.key_norm.scale.diff": (_HEAD,),
    f"{_P}final_layer.adaLN_modulation.1.diff": (2 * _DIM, _DIM),
    f"{_P}final_layer.adaLN_modulation.1.diff_b": (2 * _DIM,),
}
_LORA = f"{_P}double_blocks.0.img_attn.proj"  # a LoRA pair (rank 4, alpha 2) beside the diff on the same weight


def _write(name: str, extra: dict) -> callable:
    def write(folder: str, _model: str) -> str:
        gen = torch.Generator().manual_seed(43)
        tensors = {key: torch.randn(*shape, generator=gen) * 0.05 for key, shape in {**_SHAPES, **extra}.items()}
        tensors[f"{_LORA}.lora_down.weight"] = torch.randn(4, _DIM, generator=gen) / _DIM**0.5
        tensors[f"{_LORA}.lora_up.weight"] = torch.randn(_DIM, 4, generator=gen)
        tensors[f"{_LORA}.alpha"] = torch.tensor(2.0)
        path = os.path.join(folder, f"{name}.safetensors")
        save_file(tensors, path)
        return path
    return write


def _rows_cut(tensor: torch.Tensor, params: list[str], sizes: list[int]) -> dict:
    return dict(zip(params, tensor.split(sizes)))


def _expected(path: str) -> dict:
    """{diffusers parameter: change at strength 1}, each fused diff cut by hand."""
    from safetensors.torch import load_file

    t = {key.removeprefix(_P): value.double() for key, value in load_file(path).items()}
    block, single = "transformer_blocks.0.", "single_transformer_blocks.0."
    qkv = [f"{block}attn.to_{p}" for p in "qkv"]
    linear1 = [f"{single}attn.to_{p}" for p in "qkv"] + [f"{single}proj_mlp"]
    out = {
        **_rows_cut(t["double_blocks.0.img_attn.qkv.diff"], [f"{m}.weight" for m in qkv], [_DIM] * 3),
        **_rows_cut(t["double_blocks.0.img_attn.qkv.diff_b"], [f"{m}.bias" for m in qkv], [_DIM] * 3),
        **_rows_cut(t["single_blocks.0.linear1.diff"], [f"{m}.weight" for m in linear1], [_DIM] * 3 + [_MLP]),
        **_rows_cut(t["single_blocks.0.linear1.diff_b"], [f"{m}.bias" for m in linear1], [_DIM] * 3 + [_MLP]),
        f"{block}attn.norm_q.weight": t["double_blocks.0.img_attn.norm.query_norm.scale.diff"],
        f"{block}attn.norm_added_k.weight": t["double_blocks.0.txt_attn.norm.key_norm.scale.diff"],
        f"{block}ff_context.net.0.proj.bias": t["double_blocks.0.txt_mlp.0.diff_b"],
        f"{single}attn.norm_k.weight": t["single_blocks.0.norm.key_norm.scale.diff"],
    }
    for kind, role in (("weight", "diff"), ("bias", "diff_b")):  # shift, scale -> scale, shift
        shift, scale = t[f"final_layer.adaLN_modulation.1.{role}"].chunk(2)
        out[f"norm_out.linear.{kind}"] = torch.cat([scale, shift])
    lora = "double_blocks.0.img_attn.proj"
    up, down = t[f"{lora}.lora_up.weight"], t[f"{lora}.lora_down.weight"]
    out[f"{block}attn.to_out.0.weight"] = t[f"{lora}.diff"] + 2.0 / 4 * up @ down
    out[f"{block}attn.to_out.0.bias"] = t[f"{lora}.diff_b"]
    return out


def rows() -> list[dict]:
    """The Flux full-diff files, as a Case's keyword arguments."""
    layout = "ComfyUI full diffs in BFL names (`double_blocks.0.img_attn.qkv.diff`, `linear1`, norm `.scale.diff`)"
    return [
        dict(name="flux-comfyui-full-diffs", kind="flux", layout=layout,
             alpha_from="`.alpha` for the factors; a diff has none", write=_write("flux_comfy_diffs", {}),
             reference="math", spec={"strength": 0.7}, expected=_expected),
        dict(name="flux-comfyui-full-diff-unknown-module", kind="flux",
             layout="ComfyUI full diff on a BFL name no rule names (`img_attn.gate.diff`)", alpha_from="-",
             write=_write("flux_comfy_unknown", {f"{_P}double_blocks.0.img_attn.gate.diff": (_DIM, _DIM)}),
             reference="refused", refusal=r"diffusion_model\.double_blocks\.0\.img_attn\.gate\.diff' \(lora_cache's "
                                          r"rules for this model name no such module"),
    ]
