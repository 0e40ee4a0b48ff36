"""The corpus's files for the layouts diffusers' converters take only in part: kohya files
whose header states an ``ss_network_alpha`` no loader reads, fp8 factors, kohya SDXL's SGM
block names, musubi-tuner's and ComfyUI's original names for Wan and HunyuanVideo (some
modules, some ``.alpha``), ai-toolkit's Flux files in BFL names with peft's factors, and
files that mix two layouts.

Each is held to the loader its producer targets: diffusers' ``lora_state_dict`` (with
``unet_config``, as ``load_lora_weights`` passes it) + ``load_lora_adapter`` + ``fuse_lora``
where diffusers merges it, else ComfyUI's math written here (``alpha / rank * up @ down``,
alpha = rank without ``.alpha``, a fused projection's up rows split in order over
diffusers' weights), which kohya's ``create_network_from_weights`` shares.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from hostmem.safetensors.mapping import save_file

RANK = 4


def _pair(gen, rows: int, cols: int, rank: int = RANK, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return ((torch.randn(rank, cols, generator=gen) / cols**0.5).to(dtype),
            (torch.randn(rows, rank, generator=gen)).to(dtype))


def _file(name: str, stems: dict, names=("lora_down.weight", "lora_up.weight"), metadata: dict | None = None,
          dtype=torch.float32, seed: int = 43) -> Callable[[str, str], str]:
    """A file of ``stems``: ``{stem: (rows, cols, alpha or None, rank)}`` under the factor names
    ``names`` (down, up), in ``dtype``, with header ``metadata``."""
    def write(folder: str, _model: str) -> str:
        gen, tensors = torch.Generator().manual_seed(seed), {}
        for stem, (rows, cols, alpha, rank) in stems.items():
            down, up = _pair(gen, rows, cols, rank, dtype)
            tensors[f"{stem}.{names[0]}"], tensors[f"{stem}.{names[1]}"] = down, up
            if alpha is not None:
                tensors[f"{stem}.alpha"] = torch.tensor(float(alpha))
        path = os.path.join(folder, f"{name}.safetensors")
        save_file(tensors, path, metadata=metadata)
        return path
    return write


def _comfyui_math(placement: dict[str, list[str]], heights: dict | None = None) -> Callable[[str], dict]:
    """ComfyUI's (and kohya's) meaning of a file: each stem's ``alpha / rank * up @ down`` (alpha =
    rank without ``.alpha``), its up rows split in order over the listed weights (a fused
    projection), each part as tall as the weight; ``[1/2]``-style halves are not used here."""
    def expected(path: str) -> dict:
        from safetensors.torch import load_file

        tensors, deltas = load_file(path), {}
        for stem, params in placement.items():
            down, up = (next(tensors[f"{stem}.{n}"] for n in names if f"{stem}.{n}" in tensors)
                        for names in (("lora_down.weight", "lora_A.weight"), ("lora_up.weight", "lora_B.weight")))
            rank = down.shape[0]
            alpha = float(tensors[f"{stem}.alpha"]) if f"{stem}.alpha" in tensors else rank
            rows = _rows(params, up.shape[0], heights or {})
            for param, (start, stop) in zip(params, rows):
                deltas[f"{param}.weight"] = alpha / rank * up.double()[start:stop] @ down.double()
        return deltas
    return expected


def _rows(params: list[str], height: int, heights: dict) -> list[tuple[int, int]]:
    """Each weight's rows of a fused up: ``heights`` by module (an uneven split), else equal parts."""
    sizes = [heights.get(p.split(".", 2)[-1], 0) for p in params]
    if not all(sizes):
        sizes = [height // len(params)] * len(params)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(a, a + n) for a, n in zip(starts, sizes)]


_HY = 20  # tests.conformance.models.HUNYUAN's width: 2 heads of 10
_HY_HEIGHTS = {"attn.to_q": _HY, "attn.to_k": _HY, "attn.to_v": _HY, "proj_mlp": 4 * _HY}  # linear1's split
_HY_DOUBLE = {"img_attn_qkv": ((3 * _HY, _HY), [f"transformer_blocks.0.attn.to_{p}" for p in "qkv"]),
              "txt_attn_proj": ((_HY, _HY), ["transformer_blocks.0.attn.to_add_out"]),
              "img_mlp_fc1": ((4 * _HY, _HY), ["transformer_blocks.0.ff.net.0.proj"])}
_HY_SINGLE = {"linear1": ((7 * _HY, _HY), [f"single_transformer_blocks.0.{m}" for m in
                                           ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")]),
              "linear2": ((_HY, 5 * _HY), ["single_transformer_blocks.0.proj_out"]),
              "modulation_linear": ((3 * _HY, _HY), ["single_transformer_blocks.0.norm.linear"])}


def _hunyuan(spell: Callable[[str, str], str], alphas: dict) -> tuple[dict, dict]:
    """HunyuanVideo's original names spelt by ``spell(where, name)``: ``(stems, placement)``."""
    stems, placement = {}, {}
    for where, table in (("double_blocks", _HY_DOUBLE), ("single_blocks", _HY_SINGLE)):
        for name, ((rows, cols), params) in table.items():
            stem = spell(where, name)
            stems[stem] = (rows, cols, alphas.get(name), RANK)
            placement[stem] = params
    return stems, placement


def _musubi(where: str, name: str) -> str:
    return f"lora_unet_{where}_0_{name}"


def _comfy(where: str, name: str) -> str:  # HunyuanVideo's own names keep img_attn_qkv; its mlp is img_mlp.fc1
    dotted = name.replace("mlp_fc", "mlp.fc").replace("modulation_linear", "modulation.linear")
    return f"diffusion_model.{where}.0.{dotted}"


_HY_MUSUBI, _HY_MUSUBI_AT = _hunyuan(_musubi, {"img_attn_qkv": 2.0, "linear1": 1.0, "linear2": 8.0})
_HY_COMFY, _HY_COMFY_AT = _hunyuan(_comfy, {})

_WAN = 24
_WAN_MUSUBI = {"lora_unet_blocks_0_self_attn_q": (_WAN, _WAN, 2.0, RANK),  # some modules; some .alpha
               "lora_unet_blocks_1_cross_attn_o": (_WAN, _WAN, None, RANK),
               "lora_unet_blocks_1_ffn_0": (32, _WAN, 8.0, RANK)}
_WAN_MUSUBI_AT = {"lora_unet_blocks_0_self_attn_q": ["blocks.0.attn1.to_q"],
                  "lora_unet_blocks_1_cross_attn_o": ["blocks.1.attn2.to_out.0"],
                  "lora_unet_blocks_1_ffn_0": ["blocks.1.ffn.net.0.proj"]}
_WAN_MUSUBI_NO_ALPHA = {stem: (rows, cols, None, rank) for stem, (rows, cols, _, rank) in _WAN_MUSUBI.items()}
_WAN_MIXED = {"transformer.blocks.0.attn1.to_q": (_WAN, _WAN, None, RANK),
              "lora_unet_blocks_1_self_attn_k": (_WAN, _WAN, 2.0, RANK)}
_WAN_MIXED_AT = {"transformer.blocks.0.attn1.to_q": ["blocks.0.attn1.to_q"],
                 "lora_unet_blocks_1_self_attn_k": ["blocks.1.attn1.to_k"]}

_FLUX_BFL = {"diffusion_model.double_blocks.0.img_attn.qkv": (96, 32, None, RANK),
             "diffusion_model.double_blocks.0.txt_mlp.2": (32, 128, None, RANK),
             "diffusion_model.single_blocks.0.linear2": (32, 160, None, RANK)}
_FLUX_BFL_AT = {"diffusion_model.double_blocks.0.img_attn.qkv": [f"transformer_blocks.0.attn.to_{p}" for p in "qkv"],
                "diffusion_model.double_blocks.0.txt_mlp.2": ["transformer_blocks.0.ff_context.net.2"],
                "diffusion_model.single_blocks.0.linear2": ["single_transformer_blocks.0.proj_out"]}

_UNET = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0"
_SD_NO_ALPHA = {f"{_UNET}_attn1_to_q": (32, 32, None, RANK), f"{_UNET}_attn2_to_k": (32, 32, None, RANK),
                "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_ff_net_2": (32, 128, None, RANK)}
_SD_DYNAMIC = {f"{_UNET}_attn1_to_q": (32, 32, 3.0, 6), f"{_UNET}_attn2_to_k": (32, 32, 1.0, 2),
               "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_ff_net_2": (32, 128, 5.0, 5)}
_SD_DYNAMIC_AT = {f"{_UNET}_attn1_to_q": ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"],
                  f"{_UNET}_attn2_to_k": ["down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k"],
                  "lora_unet_up_blocks_1_attentions_0_transformer_blocks_0_ff_net_2":
                  ["up_blocks.1.attentions.0.transformer_blocks.0.ff.net.2"]}
_SGM = {"lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q": (32, 32, 2.0, RANK),  # down_blocks.0.attentions.0
        "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k": (64, 32, 2.0, RANK),  # mid_block.attentions.0
        "lora_unet_output_blocks_3_1_transformer_blocks_0_attn1_to_v": (32, 32, 2.0, RANK)}  # up_blocks.1.attentions.1
_SD_MIXED = {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": (32, 32, None, RANK),
             f"{_UNET}_attn1_to_k": (32, 32, 2.0, RANK)}
_SD_MIXED_AT = {"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q":
                ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"],
                f"{_UNET}_attn1_to_k": ["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k"]}
_PEFT_NAMES = ("lora_A.weight", "lora_B.weight")


def _widened(write: Callable[[str, str], str]) -> Callable[[str, str], str]:
    """The same file with its fp8 factors stored in float32 (the same values): what diffusers
    merges on a CPU, where it cannot scale fp8 itself."""
    def wrapped(folder: str, model_folder: str) -> str:
        from safetensors.torch import load_file

        path = write(folder, model_folder)
        widened = os.path.join(folder, "widened.safetensors")
        save_file({k: v.float() for k, v in load_file(path).items()}, widened)
        return widened
    return wrapped


def _peft_bin(folder: str, model_folder: str) -> str:
    """peft's ``save_pretrained(safe_serialization=False)``: ``adapter_model.bin`` (torch.save)
    beside its ``adapter_config.json``, named by the file's path."""
    from peft import LoraConfig, get_peft_model

    from tests.conformance.models import load_model

    torch.manual_seed(7)
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["to_q", "ffn.net.2"], init_lora_weights=False)
    out = os.path.join(folder, "peft_bin")
    get_peft_model(load_model("wan", model_folder), lora).save_pretrained(out, safe_serialization=False)
    return os.path.join(out, "adapter_model.bin")


_WAN_MODULATION = {"diffusion_model.blocks.0.modulation.diff": ((1, 6, _WAN), "blocks.0.scale_shift_table"),
                   "diffusion_model.head.modulation.diff": ((1, 2, _WAN), "scale_shift_table")}


def _wan_modulation(folder: str, _model: str) -> str:
    """A ComfyUI Wan file with full diffs of the modulation tables (diffusers' ``scale_shift_table``,
    a bare parameter) beside a LoRA pair with its ``.alpha``."""
    gen = torch.Generator().manual_seed(47)
    down, up = _pair(gen, _WAN, _WAN)
    tensors = {"diffusion_model.blocks.1.self_attn.q.lora_down.weight": down,
               "diffusion_model.blocks.1.self_attn.q.lora_up.weight": up,
               "diffusion_model.blocks.1.self_attn.q.alpha": torch.tensor(2.0),
               **{key: torch.randn(*shape, generator=gen) * 0.1 for key, (shape, _) in _WAN_MODULATION.items()}}
    path = os.path.join(folder, "wan-modulation.safetensors")
    save_file(tensors, path)
    return path


def _wan_modulation_expected(path: str) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(path)
    stem = "diffusion_model.blocks.1.self_attn.q"
    deltas = {param: tensors[key].double() for key, (_, param) in _WAN_MODULATION.items()}
    up, down = tensors[f"{stem}.lora_up.weight"].double(), tensors[f"{stem}.lora_down.weight"].double()
    deltas["blocks.1.attn1.to_q.weight"] = 2.0 / RANK * up @ down
    return deltas


def rows() -> list[dict]:
    """Every file of this module, as a Case's keyword arguments."""
    lightx2v_e5m2 = _file("wan-lightx2v-e5m2", {f"diffusion_model.blocks.{b}.self_attn.{p}": (_WAN, _WAN, 2.0, RANK)
                                                for b in range(2) for p in "qo"}, dtype=torch.float8_e5m2)
    return [
        dict(name="unet-kohya-no-alpha-ss-network-alpha", kind="unet",
             layout="kohya SD 1.x without `.alpha`, header `ss_network_alpha=1`, `ss_network_dim=4`",
             alpha_from="none (alpha = rank): `ss_network_alpha` is a record, read by no loader",
             write=_file("sd-no-alpha", _SD_NO_ALPHA, metadata={"ss_network_alpha": "1", "ss_network_dim": "4"}),
             reference="diffusers"),
        dict(name="unet-kohya-dynamic-ranks", kind="unet",
             layout="kohya SD 1.x from `resize_lora.py --dynamic_method` (`ss_network_alpha='Dynamic'`)",
             alpha_from="`.alpha` (a rank per module)",
             write=_file("sd-dynamic", _SD_DYNAMIC, metadata={"ss_network_alpha": "Dynamic",
                                                              "ss_network_dim": "Dynamic"}),
             # kohya's meaning (the producer's loader): diffusers 0.42 gives the rank-2, alpha-1 module 3 / 2
             reference="math", expected=_comfyui_math(_SD_DYNAMIC_AT)),
        dict(name="unet-kohya-sdxl-sgm-names", kind="unet",
             layout="kohya SDXL in SGM block names (`lora_unet_input_blocks_1_1_…`)",
             alpha_from="`.alpha`", write=_file("sgm", _SGM), reference="diffusers"),
        dict(name="unet-mixed-diffusers-and-kohya", kind="unet",
             layout="a file mixing diffusers' (`unet.…lora_A`) and kohya's (`lora_unet_…`) keys",
             alpha_from="`.alpha` where stored, else alpha = rank", write=_file("sd-mixed", _SD_MIXED),
             reference="math", expected=_comfyui_math(_SD_MIXED_AT)),
        dict(name="wan-diffusers-fp8-e4m3fn", kind="wan", layout="diffusers names, factors in `float8_e4m3fn`",
             alpha_from="none (alpha = rank)",
             write=_file("wan-fp8", {f"transformer.blocks.{b}.attn1.to_{p}": (_WAN, _WAN, None, RANK)
                                     for b in range(2) for p in "qk"}, _PEFT_NAMES, dtype=torch.float8_e4m3fn),
             reference="diffusers"),
        dict(name="wan-lightx2v-fp8-e5m2", kind="wan", layout="ComfyUI / lightx2v, factors in `float8_e5m2`",
             alpha_from="`.alpha` (folded by diffusers' converter)", write=lightx2v_e5m2, reference="diffusers-file",
             reference_write=_widened(lightx2v_e5m2)),
        dict(name="wan-musubi-some-modules-some-alphas", kind="wan",
             layout="musubi-tuner (`lora_unet_blocks_0_self_attn_q`), some modules, some `.alpha`",
             alpha_from="`.alpha`, else alpha = rank", write=_file("wan-musubi-some", _WAN_MUSUBI),
             reference="math", expected=_comfyui_math(_WAN_MUSUBI_AT), spec={"strength": 0.8}),
        dict(name="wan-musubi-no-alpha", kind="wan",
             layout="musubi-tuner (`lora_unet_blocks_0_self_attn_q`), no `.alpha`",
             alpha_from="none (alpha = rank)", write=_file("wan-musubi-none", _WAN_MUSUBI_NO_ALPHA),
             reference="math", expected=_comfyui_math(_WAN_MUSUBI_AT)),
        dict(name="wan-mixed-diffusers-and-musubi", kind="wan",
             layout="a file mixing diffusers' (`transformer.…lora_A`) and musubi's (`lora_unet_…`) keys",
             alpha_from="`.alpha` where stored, else alpha = rank", write=_file("wan-mixed", _WAN_MIXED),
             reference="math", expected=_comfyui_math(_WAN_MIXED_AT)),
        dict(name="hunyuan-musubi", kind="hunyuan",
             layout="musubi-tuner HunyuanVideo (`lora_unet_double_blocks_0_img_attn_qkv`, fused qkv and linear1)",
             alpha_from="`.alpha`, else alpha = rank", write=_file("hy-musubi", _HY_MUSUBI), reference="math",
             expected=_comfyui_math(_HY_MUSUBI_AT, _HY_HEIGHTS)),
        dict(name="hunyuan-comfyui-original-names", kind="hunyuan",
             layout="ComfyUI HunyuanVideo (`diffusion_model.double_blocks.0.img_attn_qkv.lora_down`)",
             alpha_from="none (alpha = rank)", write=_file("hy-comfy", _HY_COMFY), reference="math",
             expected=_comfyui_math(_HY_COMFY_AT, _HY_HEIGHTS), spec={"strength": 0.5}),
        dict(name="wan-comfyui-modulation-diffs", kind="wan",
             layout="ComfyUI Wan full diffs of `modulation` (diffusers' `scale_shift_table`) beside LoRA factors",
             alpha_from="`.alpha` for the factors; a diff has none", write=_wan_modulation, reference="math",
             expected=_wan_modulation_expected, spec={"strength": 0.7}),
        dict(name="wan-peft-adapter-model-bin", kind="wan",
             layout="peft `save_pretrained(safe_serialization=False)`: `adapter_model.bin` by path",
             alpha_from="`adapter_config.json` `lora_alpha`", write=_peft_bin, reference="peft"),
        dict(name="flux-ai-toolkit-bfl-names", kind="flux",
             layout="ai-toolkit Flux in BFL names (`diffusion_model.double_blocks.0.img_attn.qkv.lora_A`)",
             alpha_from="none (alpha = rank)", write=_file("flux-bfl", _FLUX_BFL, _PEFT_NAMES), reference="math",
             expected=_comfyui_math(_FLUX_BFL_AT)),
    ]


# What diffusers 0.42's own path does with them where it does not merge them (held by
# test_kohya_converter.py): None where it loads nothing, else a regex of its error.
DIFFUSERS_OUTCOME = {
    "flux-ai-toolkit-bfl-names": None,
    "wan-musubi-some-modules-some-alphas": "blocks_0_self_attn_k",
    "wan-musubi-no-alpha": r"\.alpha",
    "wan-mixed-diffusers-and-musubi": "list index out of range",
    "hunyuan-musubi": "chunk expects at least a 1-dimensional tensor",
}
