"""The conformance corpus: adapter files in the layouts people ship, each with the reference
it is held to.

Each :class:`Case` writes its file (by the real writer where one runs here: peft's
``save_pretrained``, diffusers' ``save_lora_weights``; else by the layout's documented
key scheme), says where its alpha is read from, and names its reference: ``diffusers``
(the loader's ``lora_state_dict`` of the file + ``load_lora_adapter`` + ``fuse_lora``),
``diffusers-model`` (the model's own ``load_lora_adapter`` of the folder + ``fuse_lora``),
``peft`` (``merge_and_unload``), ``diffusers-file`` (diffusers on a second file that
states the override as its stored alpha: ``Adapter(alpha=...)`` must mean what storing
that alpha means), ``math`` (``W + strength * delta``, where no library merges the
layout), ``lycoris`` (the same, the delta by LyCORIS's definition written in the test),
``comfyui`` (ComfyUI's ``weight_decompose``, written in the test) or ``refused`` (the
message the refusal must carry). ``docs/gen_adapter_formats.py``
turns the list into the table of docs/adapter-formats.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hostmem.safetensors.mapping import save_file
from tests.conformance.corpus_families import rows as family_rows
from tests.conformance.corpus_flux_diffs import rows as flux_diff_rows
from tests.conformance.corpus_last_mile import rows as last_mile_rows
from tests.conformance.corpus_lycoris import comfyui_decompose
from tests.conformance.corpus_lycoris import rows as lycoris_rows

RANK = 8
_H3_DIM = 128  # tests.conformance.models.H3's hidden size


@dataclass(frozen=True)
class Case:
    """One adapter file of the corpus and the reference its merge is held to."""

    name: str
    kind: str  # the tiny model (tests.conformance.models): h3, qwen, wan, flux, sd3, hunyuan, ltx, zimage, unet
    layout: str  # the layout, in the words its users know it by
    alpha_from: str  # where its alpha is read from
    write: Callable[[str, str], str]  # (folder, model folder) -> the adapter path
    reference: str  # diffusers, diffusers-model, peft, diffusers-file, math, comfyui, lycoris, refused
    spec: dict = field(default_factory=dict)  # lora_cache.Adapter's options (alpha, strength)
    reference_write: Callable[[str, str], str] | None = None  # diffusers-file: the file diffusers loads
    expected: Callable[[str], dict] | None = None  # math: {param: delta at strength 1} from the file
    refusal: str = ""  # refused: a regex the message must match


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _h3_ai_toolkit(header: dict) -> Callable[[str, str], str]:
    """ai-toolkit's MiniMax-H3 file: ``diffusion_model.blocks.N.attn.qkv_proj.lora_A/B``,
    no ``.alpha`` tensors, the training alpha in the header (lightx2v's H3 Turbo)."""
    def write(folder: str, _model: str) -> str:
        gen, tensors = _gen(1), {}
        for block in range(2):
            stem = f"diffusion_model.blocks.{block}.attn.qkv_proj"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(RANK, _H3_DIM, generator=gen) / _H3_DIM**0.5
            tensors[f"{stem}.lora_B.weight"] = torch.randn(3 * _H3_DIM, RANK, generator=gen)
        path = os.path.join(folder, f"h3_{'_'.join(f'{k}{v}' for k, v in header.items())}.safetensors")
        save_file(tensors, path, metadata=header)
        return path
    return write


_WAN_DIM = 24


def _lightx2v(alpha: float | None) -> Callable[[str, str], str]:
    """lightx2v's Wan file (ComfyUI names): ``diffusion_model.blocks.N.self_attn.q.lora_down``,
    ``.lora_up``, a per-module ``.alpha`` that diffusers' converter folds."""
    def write(folder: str, _model: str) -> str:
        gen, tensors = _gen(5), {}
        for block in range(2):
            for module in ("self_attn.q", "self_attn.o", "cross_attn.k"):
                stem = f"diffusion_model.blocks.{block}.{module}"
                tensors[f"{stem}.lora_down.weight"] = torch.randn(4, _WAN_DIM, generator=gen) / _WAN_DIM**0.5
                tensors[f"{stem}.lora_up.weight"] = torch.randn(_WAN_DIM, 4, generator=gen)
                if alpha is not None:
                    tensors[f"{stem}.alpha"] = torch.tensor(alpha)
        path = os.path.join(folder, f"lightx2v_alpha{alpha if alpha is None else f'{alpha:g}'}.safetensors")
        save_file(tensors, path)
        return path
    return write


def _peft_save(folder: str, model_folder: str, targets: list[str], kind: str = "wan", prepare=None, **config) -> str:
    """peft's own ``save_pretrained`` of a random LoRA on a tiny model (Wan unless ``kind``
    says), ``prepare(peft_model)`` first changing what training would (DoRA's magnitudes)."""
    from peft import LoraConfig, get_peft_model

    from tests.conformance.models import load_model

    torch.manual_seed(3)
    lora = LoraConfig(r=RANK, lora_alpha=16, target_modules=targets, init_lora_weights=False, **config)
    out = os.path.join(folder, "peft")
    model = get_peft_model(load_model(kind, model_folder), lora)
    if prepare is not None:
        prepare(model)
    model.save_pretrained(out)
    return out


def _peft_anchored(folder: str, model_folder: str) -> str:
    return _peft_save(folder, model_folder, ["to_q", "to_k"],
                      alpha_pattern={r"^blocks\.1\.attn1\.to_k": 32, "attn2.to_q": 4},
                      rank_pattern={r"^blocks\.0\.attn1\.to_q": 4})


def _style_beside_peft(folder: str, model_folder: str) -> str:
    """A diffusers file saved into a folder that also holds a peft adapter (alpha 16 in
    its adapter_config.json, which is not this file's)."""
    from tests.clients import tiny_models as tm

    peft = _peft_save(folder, model_folder, ["to_q"])
    gen = _gen(9)
    layers = {f"blocks.{b}.attn1.to_q.{part}": torch.randn(*shape, generator=gen)
              for b in range(2) for part, shape in (("lora_A.weight", (RANK, _WAN_DIM)),
                                                    ("lora_B.weight", (_WAN_DIM, RANK)))}
    tm.classes("wan")[1].save_lora_weights(peft, transformer_lora_layers=layers, weight_name="style.safetensors")
    return os.path.join(peft, "style.safetensors")


_COMFY_DIFFS = {  # ComfyUI's full differences on a Wan file -> the diffusers parameter each changes
    "diffusion_model.blocks.1.self_attn.o.diff": "blocks.1.attn1.to_out.0.weight",
    "diffusion_model.blocks.1.norm3.diff": "blocks.1.norm2.weight",  # Wan's norm3 is diffusers' norm2
    "diffusion_model.blocks.1.norm3.diff_b": "blocks.1.norm2.bias",
    "diffusion_model.blocks.0.ffn.0.diff_b": "blocks.0.ffn.net.0.proj.bias",
    "diffusion_model.blocks.0.self_attn.q.diff_b": "blocks.0.attn1.to_q.bias",  # beside factors: lora_B.bias
}


def _comfy_wan_diffs(folder: str, _model: str) -> str:
    """A ComfyUI Wan file with LoRA factors and full diffs (weights, a norm's weight and bias)."""
    gen = _gen(11)
    stem = "diffusion_model.blocks.0.self_attn.q"
    tensors = {f"{stem}.lora_down.weight": torch.randn(4, _WAN_DIM, generator=gen),
               f"{stem}.lora_up.weight": torch.randn(_WAN_DIM, 4, generator=gen), f"{stem}.alpha": torch.tensor(2.0)}
    for key in _COMFY_DIFFS:
        shape = (_WAN_DIM, _WAN_DIM) if key.endswith(".o.diff") else (32 if ".ffn.0." in key else _WAN_DIM,)
        tensors[key] = torch.randn(*shape, generator=gen)
    path = os.path.join(folder, "comfy_wan_diffs.safetensors")
    save_file(tensors, path)
    return path


def _comfy_wan_expected(path: str) -> dict:
    from safetensors.torch import load_file

    tensors = load_file(path)
    stem = "diffusion_model.blocks.0.self_attn.q"
    up, down = tensors[f"{stem}.lora_up.weight"].double(), tensors[f"{stem}.lora_down.weight"].double()
    deltas = {param: tensors[key].double() for key, param in _COMFY_DIFFS.items()}
    deltas["blocks.0.attn1.to_q.weight"] = 2.0 / 4 * up @ down
    return deltas


def _diffusers_with_metadata(folder: str, model_folder: str) -> str:
    """diffusers' ``save_lora_weights`` with the adapter's config as metadata (alpha 16, r 8)."""
    from tests.clients import tiny_models as tm

    return os.path.join(tm.write_adapters("wan", model_folder, folder)["diffusers_meta"],
                        "pytorch_lora_weights.safetensors")


def _peft_rslora(folder: str, model_folder: str) -> str:
    return _peft_save(folder, model_folder, ["to_q", "to_v", "ffn.net.2"], use_rslora=True)


def _peft_lora_bias(folder: str, model_folder: str) -> str:
    return _peft_save(folder, model_folder, ["to_q", "ffn.net.0.proj"], lora_bias=True)


def _peft_modules_to_save(folder: str, model_folder: str) -> str:
    return _peft_save(folder, model_folder, ["to_q"], modules_to_save=["proj_out"])


def _qwen_older_spelling(folder: str, _model: str) -> str:
    """A QwenImage file in diffusers' older spelling: ``transformer.….lora.down.weight``."""
    gen, dim, tensors = _gen(23), 32, {}
    for module, (rows, cols) in {"attn.to_q": (dim, dim), "attn.add_k_proj": (dim, dim),
                                 "img_mlp.net.2": (dim, 4 * dim)}.items():
        stem = f"transformer.transformer_blocks.0.{module}.lora"
        tensors[f"{stem}.down.weight"] = torch.randn(4, cols, generator=gen) / cols**0.5
        tensors[f"{stem}.up.weight"] = torch.randn(rows, 4, generator=gen)
    path = os.path.join(folder, "qwen_older.safetensors")
    save_file(tensors, path)
    return path


def _save_lora_adapter(folder: str, model_folder: str, kind: str = "wan",
                       targets: tuple[str, ...] = ("to_q", "to_out.0")) -> str:
    """diffusers' own ``model.save_lora_adapter()``: unprefixed keys, the config in the header."""
    from peft import LoraConfig

    from tests.conformance.models import load_model

    torch.manual_seed(4)
    model = load_model(kind, model_folder)
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), init_lora_weights=False))
    out = os.path.join(folder, "save_lora_adapter")
    model.save_lora_adapter(out)
    return out


def _xlabs_flux(folder: str, _model: str) -> str:
    """XLabs' Flux layout: ``double_blocks.0.processor.qkv_lora1.down.weight`` / ``.up.weight``,
    a fused qkv LoRA that diffusers' converter splits over to_q, to_k, to_v."""
    gen, dim, tensors = _gen(13), 32, {}
    for name, rows in (("qkv_lora1", 3 * dim), ("proj_lora1", dim), ("qkv_lora2", 3 * dim), ("proj_lora2", dim)):
        tensors[f"double_blocks.0.processor.{name}.down.weight"] = torch.randn(4, dim, generator=gen) / dim**0.5
        tensors[f"double_blocks.0.processor.{name}.up.weight"] = torch.randn(rows, 4, generator=gen)
    path = os.path.join(folder, "xlabs_flux.safetensors")
    save_file(tensors, path)
    return path


def _diffsynth_h3(folder: str, _model: str) -> str:
    """DiffSynth-Studio's MiniMax-H3 layout: peft's ``.default.`` infix over the original
    checkpoint's names (no prefix), which diffusers' converter reads as head-interleaved qkv."""
    gen, tensors = _gen(17), {}
    for block in range(2):
        for module, rows in (("qkv_proj", 3 * _H3_DIM), ("out_proj", _H3_DIM)):
            stem = f"blocks.{block}.attn.{module}"
            tensors[f"{stem}.lora_A.default.weight"] = torch.randn(RANK, _H3_DIM, generator=gen) / _H3_DIM**0.5
            tensors[f"{stem}.lora_B.default.weight"] = torch.randn(rows, RANK, generator=gen)
    path = os.path.join(folder, "diffsynth_h3.safetensors")
    save_file(tensors, path)
    return path


CASES: list[Case] = [
    Case("h3-ai-toolkit-header-alpha", "h3", "ai-toolkit (`diffusion_model.…lora_A/B`)", "header `alpha`",
         _h3_ai_toolkit({"alpha": "4"}), "diffusers"),
    Case("h3-ai-toolkit-header-alpha-override", "h3", "ai-toolkit (`diffusion_model.…lora_A/B`)",
         "`Adapter(alpha=...)` over header `alpha`", _h3_ai_toolkit({"alpha": "4"}), "diffusers-file",
         spec={"alpha": 2.0}, reference_write=_h3_ai_toolkit({"alpha": "2"})),
    Case("wan-lightx2v-alpha-override", "wan", "ComfyUI / lightx2v (`diffusion_model.…lora_down/up`, `.alpha`)",
         "`Adapter(alpha=...)` over `.alpha` (folded by diffusers' converter)", _lightx2v(8.0), "diffusers-file",
         spec={"alpha": 2.0, "strength": 0.7}, reference_write=_lightx2v(2.0)),
    Case("wan-lightx2v-no-alpha-override", "wan", "ComfyUI / lightx2v without `.alpha`",
         "`Adapter(alpha=...)` (handed to diffusers' converter as every module's `.alpha`)", _lightx2v(None),
         "diffusers-file", spec={"alpha": 2.0}, reference_write=_lightx2v(2.0)),
    Case("wan-peft-anchored-patterns", "wan", "peft `save_pretrained` folder",
         "`adapter_config.json`: anchored `alpha_pattern`/`rank_pattern`", _peft_anchored, "peft"),
    Case("wan-diffusers-file-beside-peft", "wan", "diffusers `save_lora_weights` file in a peft folder",
         "none (alpha = rank): the folder's `adapter_config.json` is not its", _style_beside_peft, "diffusers"),
    Case("wan-comfyui-full-diffs", "wan", "ComfyUI full diffs (`.diff`, `.diff_b`, norms) beside LoRA factors",
         "`.alpha` for the factors; a diff has none", _comfy_wan_diffs, "math", spec={"strength": 0.6},
         expected=_comfy_wan_expected),
    Case("wan-diffusers-save-lora-adapter", "wan", "diffusers `save_lora_adapter()` (unprefixed keys, metadata)",
         "header `lora_adapter_metadata` (unprefixed)", _save_lora_adapter, "diffusers-model"),
    Case("flux-xlabs", "flux", "XLabs (`processor.qkv_lora1.down/up.weight`)", "none (alpha = rank)", _xlabs_flux,
         "diffusers"),
    Case("wan-diffusers-metadata", "wan", "diffusers `save_lora_weights` with adapter metadata",
         "header `lora_adapter_metadata` (`transformer.lora_alpha`)", _diffusers_with_metadata, "diffusers"),
    Case("wan-peft-rslora", "wan", "peft `save_pretrained` folder, rsLoRA", "`adapter_config.json` `lora_alpha` "
         "over sqrt(r)", _peft_rslora, "peft"),
    Case("wan-peft-lora-bias", "wan", "peft `save_pretrained` folder, `lora_bias`", "`adapter_config.json` "
         "`lora_alpha` (the bias scaled as B @ A)", _peft_lora_bias, "peft"),
    *(Case(**row) for row in family_rows()),  # tests/conformance/corpus_families.py
    *(Case(**row) for row in flux_diff_rows()),  # tests/conformance/corpus_flux_diffs.py
    *(Case(**row) for row in last_mile_rows()),  # tests/conformance/corpus_last_mile.py
    Case("wan-peft-modules-to-save", "wan", "peft `save_pretrained` folder, `modules_to_save`", "-",
         _peft_modules_to_save, "refused", refusal="modules_to_save"),
    Case("qwen-older-lora-down-spelling", "qwen", "diffusers' older spelling (`.lora.down.weight`)",
         "none (alpha = rank)", _qwen_older_spelling, "diffusers"),
    Case("h3-diffsynth-default-infix", "h3", "DiffSynth-Studio (`.lora_A.default.weight`)", "none (alpha = rank)",
         _diffsynth_h3, "diffusers"),
]


# LyCORIS (lycoris/modules/locon.py with DoRA, full.py), written by the trainer's key scheme
# for a diffusers Wan (LyCORIS names a module lycoris_<its name with underscores>) and read
# by lora_cache's own reader, on a diffusers model too: diffusers' converters do not take them.
_LYCORIS_WAN = {"blocks.0.attn1.to_q": (_WAN_DIM, _WAN_DIM), "blocks.1.ffn.net.0.proj": (32, _WAN_DIM),
                "blocks.1.ffn.net.2": (_WAN_DIM, 32)}


def comfyui_dora(weight, up, down, alpha, dora_scale, strength):
    """ComfyUI's ``weight_decompose`` (comfy/weight_adapter/base.py) of a LoRA pair, in float64:
    the change is alpha / rank * up @ down (:func:`comfyui_decompose` says the rest)."""
    change = alpha / down.shape[0] * (up.flatten(1).double() @ down.flatten(1).double())
    return comfyui_decompose(weight, change, dora_scale, strength)


def _lycoris_dora(on_out: bool) -> Callable[[str, str], str]:
    """A LyCORIS LoCon file with DoRA (``.dora_scale`` of shape (out, 1) for ``wd_on_out``, else
    (1, in)); beside it, the delta at strength 1 by :func:`comfyui_dora` on the model's base
    (ComfyUI's strength is linear in it: W + strength * (D - W))."""
    def write(folder: str, model_folder: str) -> str:
        from tests.conformance.models import load_model, weights

        base, gen, tensors, expected = weights(load_model("wan", model_folder)), _gen(29), {}, {}
        for module, (rows, cols) in _LYCORIS_WAN.items():
            stem = "lycoris_" + module.replace(".", "_")
            parts = {"lora_down.weight": torch.randn(4, cols, generator=gen) / cols**0.5,
                     "lora_up.weight": torch.randn(rows, 4, generator=gen) * 0.2, "alpha": torch.tensor(2.0),
                     "dora_scale": 0.5 + torch.rand((rows, 1) if on_out else (1, cols), generator=gen)}
            tensors.update({f"{stem}.{part}": value for part, value in parts.items()})
            weight = base[f"{module}.weight"]
            expected[f"{module}.weight"] = comfyui_dora(weight, parts["lora_up.weight"], parts["lora_down.weight"],
                                                        2.0, parts["dora_scale"], 1.0) - weight.double()
        path = os.path.join(folder, f"lycoris_dora_{'out' if on_out else 'in'}.safetensors")
        save_file(tensors, path)
        save_file({k: v.contiguous() for k, v in expected.items()}, path + ".expected")
        return path
    return write


def _lycoris_full(folder: str, _model: str) -> str:
    """LyCORIS's "full" algorithm: the trained weight minus the original (``.diff``), the bias's
    (``.diff_b``)."""
    gen, tensors = _gen(31), {}
    for module, (rows, cols) in _LYCORIS_WAN.items():
        stem = "lycoris_" + module.replace(".", "_")
        tensors[f"{stem}.diff"] = torch.randn(rows, cols, generator=gen) * 0.05
        tensors[f"{stem}.diff_b"] = torch.randn(rows, generator=gen) * 0.05
    path = os.path.join(folder, "lycoris_full.safetensors")
    save_file(tensors, path)
    return path


def _lycoris_full_expected(path: str) -> dict:
    """{parameter: delta} of a LyCORIS full file over :data:`_LYCORIS_WAN`."""
    from safetensors.torch import load_file

    tensors, out = load_file(path), {}
    for module in _LYCORIS_WAN:
        stem = "lycoris_" + module.replace(".", "_")
        out[f"{module}.weight"] = tensors[f"{stem}.diff"].double()
        out[f"{module}.bias"] = tensors[f"{stem}.diff_b"].double()
    return out


def _expected_beside(path: str) -> dict:
    from safetensors.torch import load_file

    return {name: value.double() for name, value in load_file(path + ".expected").items()}


CASES += [
    Case("wan-lycoris-dora-input-axis", "wan", "LyCORIS LoCon with DoRA (`.dora_scale` (1, in))", "`.alpha`",
         _lycoris_dora(False), "comfyui", spec={"strength": 0.8}, expected=_expected_beside),
    Case("wan-lycoris-dora-output-axis", "wan", "LyCORIS LoCon with DoRA, `wd_on_out` (`.dora_scale` (out, 1))",
         "`.alpha`", _lycoris_dora(True), "comfyui", spec={"strength": 0.8},
         expected=_expected_beside),
    Case("wan-lycoris-full", "wan", "LyCORIS full (`lycoris_….diff`, `.diff_b`)", "none (a diff has none)",
         _lycoris_full, "math", spec={"strength": 0.6}, expected=_lycoris_full_expected),
    *(Case(**row) for row in lycoris_rows()),  # tests/conformance/corpus_lycoris.py: LoHa, LoKr, Tucker, refusals
]


def describe(case: Case) -> dict:
    """The corpus entry as the docs table shows it."""
    outcome = "refused" if case.reference == "refused" else "merged"
    held = {"diffusers": "diffusers load + fuse", "peft": "peft merge_and_unload",
            "diffusers-model": "diffusers model.load_lora_adapter + fuse",
            "diffusers-file": "diffusers on the file storing that alpha", "math": "the math: W + strength x delta",
            "comfyui": "ComfyUI's weight_decompose, written in the test",
            "lycoris": "LyCORIS's definition (lycoris/functional), written in the test",
            "refused": "a refusal naming " + case.refusal}[case.reference]
    return {"layout": case.layout, "model": case.kind, "alpha": case.alpha_from, "outcome": outcome, "held to": held}


def dumps() -> str:
    return json.dumps([describe(c) for c in CASES], indent=1)
