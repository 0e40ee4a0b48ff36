"""The corpus's files for the families beyond the first ones: kohya files written by diffusers'
own ``convert_state_dict_to_kohya``, a conv DoRA written by peft, and the trainers' layouts
(musubi-tuner/kohya ``lora_unet_``, ComfyUI/lightx2v ``diffusion_model.``) on Wan,
MiniMax-H3, QwenImage and Flux.

:func:`rows` gives each file as the keyword arguments of a
:class:`tests.conformance.corpus.Case`; ``corpus.py`` turns them into its cases (this
module does not import it, so either can be imported first).

What diffusers 0.42 does with ``convert_state_dict_to_kohya``'s files, found by loading
each with the family's loader (``lora_state_dict`` + ``load_lora_adapter`` + ``fuse_lora``)
and held by ``test_kohya_converter.py``: the converter writes a component's prefix into
the kohya name (``transformer.transformer_blocks.0.attn.to_q`` becomes
``transformer_transformer_blocks_0_attn_to_q``) and an ``.alpha`` equal to the rank (the
adapter's own ``lora_alpha`` is not carried over). No transformer family's loader reads
that name: SD3, HunyuanVideo and LTX hand the keys back unconverted and load nothing
(one "No LoRA keys associated" warning), Flux's kohya converter drops every key (the same
warning), and ZImage's converter renames them to modules that do not exist
(``NoMatchingPeftModuleError``). lora_cache refuses each, naming the keys no module of the
model takes. Converted from the model's own keys (a peft state dict or a
``save_lora_adapter`` file, no prefix), the names are the model's modules with ``_`` for
``.``: diffusers still loads nothing (ZImage raises), while lora_cache places each LoRA on
the one module whose name it spells and merges it as the file says (alpha / rank x up @
down); that is held to the math, and Flux, whose loader drops every such key before
lora_cache sees them, is refused.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from hostmem.safetensors.mapping import save_file

RANK = 4

_KOHYA_MODULES = {  # diffusers module names a kohya file of each family changes
    "sd3": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.ff.net.2"],
    "hunyuan": ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp",
                "context_embedder.token_refiner.refiner_blocks.0.attn.to_k"],
    "ltx": ["transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn2.to_out.0", "transformer_blocks.0.ff.net.2"],
    "zimage": ["layers.0.attention.to_q", "noise_refiner.0.feed_forward.w1", "context_refiner.0.attention.to_out.0"],
    "flux": ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp", "transformer_blocks.0.ff.net.2"],
}
_DROPPED = "the converter drops every key of the file, and diffusers loads nothing of it"
_KOHYA_NAMES = {"sd3": "SD3", "hunyuan": "HunyuanVideo", "ltx": "LTX", "zimage": "ZImage", "flux": "Flux"}


def _random_lora(kind: str, model_folder: str, modules: list[str], seed: int) -> dict[str, torch.Tensor]:
    """``{module.lora_A.weight, module.lora_B.weight}`` at the tiny model's shapes (peft's names)."""
    from tests.conformance.models import load_model

    model, gen, layers = load_model(kind, model_folder), torch.Generator().manual_seed(seed), {}
    for name in modules:
        rows, cols = model.get_submodule(name).weight.shape
        layers[f"{name}.lora_A.weight"] = torch.randn(RANK, cols, generator=gen) / cols**0.5
        layers[f"{name}.lora_B.weight"] = torch.randn(rows, RANK, generator=gen)
    return layers


def _kohya_converted(kind: str, prefixed: bool) -> Callable[[str, str], str]:
    """diffusers' documented route to a kohya file: a LoRA state dict (``save_lora_weights``'
    file, ``transformer.`` prefix, or the model's own keys), ``convert_all_state_dict_to_peft``,
    then ``convert_state_dict_to_kohya``, saved as it is."""
    def write(folder: str, model_folder: str) -> str:
        from diffusers.utils import convert_all_state_dict_to_peft, convert_state_dict_to_kohya
        from safetensors.torch import load_file

        from tests.conformance.models import loader_class

        layers = _random_lora(kind, model_folder, _KOHYA_MODULES[kind], seed=29)
        if prefixed:
            loader_class(kind).save_lora_weights(folder, transformer_lora_layers=layers,
                                                 weight_name="diffusers.safetensors")
            layers = load_file(os.path.join(folder, "diffusers.safetensors"))
        path = os.path.join(folder, f"kohya_{kind}_{'prefixed' if prefixed else 'own_keys'}.safetensors")
        save_file(convert_state_dict_to_kohya(convert_all_state_dict_to_peft(layers)), path)
        return path
    return write


def _kohya_expected(kind: str, alpha: float | None = None) -> Callable[[str], dict]:
    """The file's meaning at strength 1: each ``<module with _>.lora_up/down`` on its module,
    scaled by its ``.alpha`` (or the override ``alpha``) over the rank."""
    def expected(path: str) -> dict:
        from safetensors.torch import load_file

        tensors = load_file(path)
        deltas = {}
        for name in _KOHYA_MODULES[kind]:
            stem = name.replace(".", "_")
            up, down = tensors[f"{stem}.lora_up.weight"].double(), tensors[f"{stem}.lora_down.weight"].double()
            stored = float(tensors[f"{stem}.alpha"]) if alpha is None else alpha
            deltas[f"{name}.weight"] = stored / down.shape[0] * up @ down
        return deltas
    return expected


def diffusers_outcome() -> dict[str, str | None]:
    """The corpus files diffusers 0.42's own path does not merge: name -> ``None`` where it
    loads nothing (a warning only), else a regex of the error it raises
    (``test_kohya_converter.py`` holds each, so a diffusers that learns one is noticed)."""
    from tests.conformance.corpus_last_mile import DIFFUSERS_OUTCOME

    out: dict[str, str | None] = {**dict.fromkeys(_UNREAD), **DIFFUSERS_OUTCOME}
    for kind in _KOHYA_NAMES:
        for variant in ("diffusers-file", "model-keys"):
            out[f"{kind}-kohya-converted-from-{variant}"] = "not found in the base model" if kind == "zimage" else None
    return out


def _kohya_rows() -> list[dict]:
    out = []
    for kind, family in _KOHYA_NAMES.items():
        out.append(dict(name=f"{kind}-kohya-converted-from-diffusers-file", kind=kind,
                        layout=f"kohya from diffusers' `convert_state_dict_to_kohya` of a {family} file "
                               "(`transformer_transformer_blocks_0_…`)", alpha_from="`.alpha` (the rank)",
                        write=_kohya_converted(kind, prefixed=True), reference="refused",
                        refusal=_DROPPED if kind == "flux" else r"match no module of the model:\s+transformer[._]"))
        own = dict(name=f"{kind}-kohya-converted-from-model-keys", kind=kind,
                   layout=f"kohya from diffusers' `convert_state_dict_to_kohya` of {family}'s own keys "
                          "(`transformer_blocks_0_…`)", alpha_from="`.alpha` (the rank)",
                   write=_kohya_converted(kind, prefixed=False))
        if kind == "flux":
            own.update(reference="refused", refusal=_DROPPED)
        else:
            own.update(reference="math", expected=_kohya_expected(kind), spec={"strength": 0.8})
        out.append(own)
    out.append(dict(name="sd3-kohya-converted-from-model-keys-alpha-override", kind="sd3",
                    layout="kohya from diffusers' `convert_state_dict_to_kohya` of SD3's own keys, the training "
                           "alpha given", alpha_from="`Adapter(alpha=...)` over `.alpha` (the rank)",
                    write=_kohya_converted("sd3", prefixed=False), reference="math",
                    expected=_kohya_expected("sd3", alpha=8.0), spec={"alpha": 8.0}))
    return out


def _trained_magnitudes(model) -> None:
    """Move peft's DoRA magnitudes off the norms it starts them at, as training does."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(0.5 + torch.rand(param.shape, generator=gen))


def _unet_conv_dora(folder: str, model_folder: str) -> str:
    """peft's DoRA (``use_dora=True``) on an SD 1.x UNet's 3x3 and 1x1 convs and a linear."""
    from tests.conformance.corpus import _peft_save

    return _peft_save(folder, model_folder, ["conv1", "conv2", "conv_shortcut", "proj_in", "to_q"], kind="unet",
                      use_dora=True, prepare=_trained_magnitudes)


def _unet_kohya_locon(folder: str, model_folder: str) -> str:
    """A kohya LoCon file for an SD 1.x UNet (3x3 conv LoRAs: a (r, in, 3, 3) down, a (out, r,
    1, 1) up) written by diffusers' ``convert_state_dict_to_kohya`` from peft's factors, as
    SD trainers write them (``lora_unet_down_blocks_0_resnets_0_conv1``), the alpha set to 2."""
    from diffusers.utils import convert_state_dict_to_kohya
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    from tests.conformance.models import load_model

    torch.manual_seed(6)
    lora = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=["conv1", "conv2", "conv_shortcut", "to_k"],
                      init_lora_weights=False)
    layers = get_peft_model_state_dict(get_peft_model(load_model("unet", model_folder), lora))
    kohya = convert_state_dict_to_kohya({f"unet.{k.removeprefix('base_model.model.')}": v for k, v in layers.items()})
    path = os.path.join(folder, "unet_locon.safetensors")
    save_file({k: torch.tensor(2.0) if k.endswith(".alpha") else v.contiguous() for k, v in kohya.items()}, path)
    return path


def _factors(name: str, stems: dict[str, tuple[int, int]], down: str, up: str,
             alpha: float | None) -> Callable[[str, str], str]:
    """A file written to a trainer's key scheme: ``<stem>.<down>`` (rank, cols), ``<stem>.<up>``
    (rows, rank) and, with ``alpha``, ``<stem>.alpha`` per module."""
    def write(folder: str, _model: str) -> str:
        gen, tensors = torch.Generator().manual_seed(31), {}
        for stem, (rows, cols) in stems.items():
            tensors[f"{stem}.{down}"] = torch.randn(RANK, cols, generator=gen) / cols**0.5
            tensors[f"{stem}.{up}"] = torch.randn(rows, RANK, generator=gen)
            if alpha is not None:
                tensors[f"{stem}.alpha"] = torch.tensor(alpha)
        path = os.path.join(folder, f"{name}.safetensors")
        save_file(tensors, path)
        return path
    return write


_KOHYA = ("lora_down.weight", "lora_up.weight")
_WAN, _H3, _QWEN = 24, 128, 32  # the tiny models' widths (tests.clients.tiny_models, tests.conformance.models)
_LAYOUTS = [  # (name, kind, layout, alpha from, stems -> (rows, cols), down, up, alpha): held to diffusers
    ("wan-musubi-kohya", "wan", "musubi-tuner / kohya (`lora_unet_blocks_0_self_attn_q.lora_down`)", "`.alpha`",
     {f"lora_unet_blocks_{b}_{m}": (_WAN, _WAN) for b in range(2)  # every module: diffusers' converter pops them all
      for m in (f"{a}_attn_{p}" for a in ("self", "cross") for p in "qkvo")}
     | {f"lora_unet_blocks_{b}_ffn_{i}": shape for b in range(2) for i, shape in ((0, (32, _WAN)), (2, (_WAN, 32)))},
     *_KOHYA, 2.0),
    ("h3-musubi-kohya", "h3", "musubi-tuner / kohya (`lora_unet_blocks_0_attn_qkv_proj.lora_down`)", "`.alpha`",
     {f"lora_unet_blocks_{b}_attn_{m}": (rows, _H3) for b in range(2)
      for m, rows in (("qkv_proj", 3 * _H3), ("out_proj", _H3))}, *_KOHYA, 2.0),
    ("h3-comfyui", "h3", "ComfyUI (`diffusion_model.blocks.0.attn.qkv_proj.lora_down`, `.alpha`)", "`.alpha`",
     {f"diffusion_model.blocks.{b}.attn.qkv_proj": (3 * _H3, _H3) for b in range(2)}, *_KOHYA, 8.0),
    ("qwen-kohya", "qwen", "kohya (`lora_unet_transformer_blocks_0_attn_to_q.lora_down`)", "`.alpha`",
     {f"lora_unet_transformer_blocks_0_{m}": (rows, cols) for m, rows, cols in
      (("attn_to_q", _QWEN, _QWEN), ("attn_add_k_proj", _QWEN, _QWEN), ("img_mlp_net_2", _QWEN, 4 * _QWEN))},
     *_KOHYA, 2.0),
    ("qwen-comfyui-lightx2v", "qwen", "ComfyUI / lightx2v (`diffusion_model.transformer_blocks.0.attn.to_q.lora_down`)",
     "`.alpha`", {f"diffusion_model.transformer_blocks.0.{m}": (rows, cols) for m, rows, cols in
                  (("attn.to_q", _QWEN, _QWEN), ("attn.to_add_out", _QWEN, _QWEN),
                   ("txt_mlp.net.0.proj", 4 * _QWEN, _QWEN))},
     *_KOHYA, 8.0),
    ("wan-comfyui-peft-factors", "wan", "ComfyUI with peft's factors (`diffusion_model.blocks.0.self_attn.q.lora_A`)",
     "none (alpha = rank)", {f"diffusion_model.blocks.{b}.{m}": (_WAN, _WAN) for b in range(2)
                             for m in ("self_attn.k", "cross_attn.o")}, "lora_A.weight", "lora_B.weight", None),
    ("wan-diffsynth-default-infix", "wan", "DiffSynth-Studio (`blocks.0.self_attn.q.lora_A.default.weight`)",
     "none (alpha = rank)", {f"blocks.{b}.{m}": (_WAN, _WAN) for b in range(2) for m in ("self_attn.q", "cross_attn.v")}
     | {"blocks.1.ffn.2": (_WAN, 32)}, "lora_A.default.weight", "lora_B.default.weight", None),
    ("flux-comfyui", "flux", "ComfyUI (`diffusion_model.double_blocks.0.img_attn.proj.lora_down`, `.alpha`)",
     "`.alpha`", {"diffusion_model.double_blocks.0.img_attn.proj": (32, 32),
                  "diffusion_model.double_blocks.0.txt_mlp.2": (32, 128),
                  "diffusion_model.single_blocks.0.linear2": (32, 32 + 128)}, *_KOHYA, 2.0),
]
_UNREAD = {  # layouts diffusers 0.42 loads nothing of (a warning only), refused here with the keys named
    "wan-diffsynth-default-infix": r"match no module of the model:\s+blocks\.0\.cross_attn\.v\.lora_A\.default",
}


_FLUX_KOHYA = {  # kohya sd-scripts' Flux modules (BFL names) -> the diffusers weights their up rows split over
    "lora_unet_double_blocks_0_img_attn_qkv": [f"transformer_blocks.0.attn.to_{p}" for p in "qkv"],
    "lora_unet_double_blocks_0_txt_attn_proj": ["transformer_blocks.0.attn.to_add_out"],
    "lora_unet_single_blocks_0_linear2": ["single_transformer_blocks.0.proj_out"],
}


def _flux_kohya_expected(path: str) -> dict:
    """The file's meaning: alpha / rank x up @ down, a fused qkv's up rows split in order."""
    from safetensors.torch import load_file

    tensors, deltas = load_file(path), {}
    for stem, params in _FLUX_KOHYA.items():
        up, down = tensors[f"{stem}.lora_up.weight"].double(), tensors[f"{stem}.lora_down.weight"].double()
        scale = float(tensors[f"{stem}.alpha"]) / down.shape[0]
        for param, part in zip(params, up.chunk(len(params))):
            deltas[f"{param}.weight"] = scale * part @ down
    return deltas


def _layout_rows() -> list[dict]:
    held = {name: {"reference": "refused", "refusal": refusal} for name, refusal in _UNREAD.items()}
    return [dict(name=name, kind=kind, layout=layout, alpha_from=alpha_from,
                 write=_factors(name, stems, down, up, alpha),
                 **held.get(name, {"reference": "diffusers"}))
            for name, kind, layout, alpha_from, stems, down, up, alpha in _LAYOUTS]


def _diffusers_saved(kind: str, variant: str) -> Callable[[str, str], str]:
    """diffusers' ``save_lora_weights`` of a peft LoRA (alpha 16, r 8) with its config as
    metadata (``diffusers_meta``) or without (``diffusers_plain``: alpha = rank)."""
    def write(folder: str, model_folder: str) -> str:
        from tests.clients import tiny_models as tm

        return os.path.join(tm.write_adapters(kind, model_folder, folder)[variant], "pytorch_lora_weights.safetensors")
    return write


def _save_lora_adapter(kind: str, targets: tuple[str, ...]) -> Callable[[str, str], str]:
    def write(folder: str, model_folder: str) -> str:
        from tests.conformance.corpus import _save_lora_adapter as save

        return save(folder, model_folder, kind, targets)
    return write


def _diffusers_metadata(kind: str, modules: list[str]) -> Callable[[str, str], str]:
    """The family's ``save_lora_weights`` with the adapter's config as metadata (alpha 8, r 4:
    a reader that ignores it merges half the delta)."""
    def write(folder: str, model_folder: str) -> str:
        from peft import LoraConfig

        from tests.conformance.models import loader_class

        layers = _random_lora(kind, model_folder, modules, seed=37)
        config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=modules).to_dict()
        loader_class(kind).save_lora_weights(folder, transformer_lora_layers=layers,
                                             transformer_lora_adapter_metadata=config)
        return os.path.join(folder, "pytorch_lora_weights.safetensors")
    return write


def _peft(kind: str, targets: list[str], **config) -> Callable[[str, str], str]:
    def write(folder: str, model_folder: str) -> str:
        from tests.conformance.corpus import _peft_save

        return _peft_save(folder, model_folder, targets, kind=kind, **config)
    return write


def _diffsynth_qwen(folder: str, model_folder: str) -> str:
    """DiffSynth-Studio's QwenImage layout: the model's own names with peft's ``.default.`` infix."""
    modules = [f"transformer_blocks.0.{m}" for m in ("attn.to_q", "attn.add_v_proj", "img_mlp.net.2")]
    layers = _random_lora("qwen", model_folder, modules, seed=41)
    path = os.path.join(folder, "diffsynth_qwen.safetensors")
    save_file({k.replace(".weight", ".default.weight"): v for k, v in layers.items()}, path)
    return path


_H3_ATTN = ["to_q", "to_k", "to_out.0", "ff.net.0.proj"]
_PEFT_ROWS = [  # (name, kind, layout, alpha from, targets, LoraConfig fields): held to peft's merge_and_unload
    ("h3-peft-rslora-patterns", "h3", "peft `save_pretrained` folder, rsLoRA and patterns",
     "`adapter_config.json`: `alpha_pattern`/`rank_pattern` over sqrt(r)", _H3_ATTN,
     {"use_rslora": True, "alpha_pattern": {r"^transformer_blocks\.1\.attn\.to_k": 32},
      "rank_pattern": {"ff.net.0.proj": 4}}),
    ("flux-peft-rslora-patterns", "flux", "peft `save_pretrained` folder, rsLoRA and patterns",
     "`adapter_config.json`: `alpha_pattern`/`rank_pattern` over sqrt(r)", ["to_q", "add_k_proj", "proj_mlp"],
     {"use_rslora": True, "alpha_pattern": {"add_k_proj": 4},
      "rank_pattern": {r"^single_transformer_blocks\.0\.proj_mlp": 2}}),
    ("qwen-peft", "qwen", "peft `save_pretrained` folder", "`adapter_config.json` `lora_alpha`",
     ["to_q", "add_k_proj", "img_mlp.net.2"], {}),
]


_WRITERS = {"sd3": ["to_q", "add_k_proj", "ff.net.2"], "hunyuan": ["to_q", "proj_mlp", "to_k"],  # peft's targets
            "ltx": ["to_q", "to_out.0", "ff.net.2"], "zimage": ["to_q", "w1", "to_out.0"]}


def _writer_rows() -> list[dict]:
    """The libraries' own writers on the families that had only kohya files: peft's
    ``save_pretrained`` (held to ``merge_and_unload``) and diffusers' ``save_lora_weights``
    with metadata (held to ``load_lora_weights`` + ``fuse_lora``)."""
    out = []
    for kind, targets in _WRITERS.items():
        out.append(dict(name=f"{kind}-peft", kind=kind, layout="peft `save_pretrained` folder",
                        alpha_from="`adapter_config.json` `lora_alpha`", write=_peft(kind, targets), reference="peft"))
        out.append(dict(name=f"{kind}-diffusers-metadata", kind=kind,
                        layout="diffusers `save_lora_weights` with adapter metadata",
                        alpha_from="header `lora_adapter_metadata` (`transformer.lora_alpha`)",
                        write=_diffusers_metadata(kind, _KOHYA_MODULES[kind]), reference="diffusers"))
    return out


def rows() -> list[dict]:
    """Every file of this module, as a Case's keyword arguments."""
    return [
        *_writer_rows(),
        *_kohya_rows(),
        dict(name="unet-peft-conv-dora", kind="unet", layout="peft `save_pretrained` folder, DoRA on 3x3 and 1x1 convs",
             alpha_from="`adapter_config.json` `lora_alpha`; magnitudes over all dims but the output one",
             write=_unet_conv_dora, reference="peft"),
        dict(name="unet-kohya-locon-conv", kind="unet", layout="kohya LoCon (`lora_unet_…_resnets_0_conv1`, 3x3 "
             "down)", alpha_from="`.alpha`", write=_unet_kohya_locon, reference="diffusers"),
        dict(name="flux-kohya-sd-scripts", kind="flux",
             layout="kohya sd-scripts (`lora_unet_double_blocks_0_img_attn_qkv`)",
             alpha_from="`.alpha`", reference="math", expected=_flux_kohya_expected, spec={"strength": 0.9},
             write=_factors("flux-kohya-sd-scripts", {"lora_unet_double_blocks_0_img_attn_qkv": (96, 32),
                                                      "lora_unet_double_blocks_0_txt_attn_proj": (32, 32),
                                                      "lora_unet_single_blocks_0_linear2": (32, 160)}, *_KOHYA, 2.0)),
        dict(name="wan-diffusers-no-metadata", kind="wan", layout="diffusers `save_lora_weights` without metadata",
             alpha_from="none (alpha = rank)", write=_diffusers_saved("wan", "diffusers_plain"), reference="diffusers"),
        dict(name="flux-diffusers-metadata", kind="flux", layout="diffusers `save_lora_weights` with adapter metadata",
             alpha_from="header `lora_adapter_metadata` (`transformer.lora_alpha`)",
             write=_diffusers_saved("flux", "diffusers_meta"), reference="diffusers"),
        *(dict(name=f"{kind}-diffusers-save-lora-adapter", kind=kind,
               layout="diffusers `save_lora_adapter()` (unprefixed keys, metadata)",
               alpha_from="header `lora_adapter_metadata` (unprefixed)", write=_save_lora_adapter(kind, targets),
               reference="diffusers-model")
          for kind, targets in (("h3", ("to_q", "ff.net.2")), ("flux", ("to_k", "proj_mlp", "to_add_out")))),
        *_layout_rows(),
        *(dict(name=name, kind=kind, layout=layout, alpha_from=alpha_from, write=_peft(kind, targets, **config),
               reference="peft") for name, kind, layout, alpha_from, targets, config in _PEFT_ROWS),
        dict(name="h3-peft-lora-bias-on-a-layer-without-bias", kind="h3",
             layout="peft `save_pretrained` folder, `lora_bias` on a layer without a bias", alpha_from="-",
             write=_peft("h3", ["to_q", "to_out.0"], lora_bias=True), reference="refused",
             refusal=r"lora_B\.bias' changes '.*\.bias', which the model does not have"),  # peft: "Impossible to merge"
        dict(name="h3-diffusers-metadata", kind="h3", layout="diffusers `save_lora_weights` with adapter metadata",
             alpha_from="header `lora_adapter_metadata` (`transformer.lora_alpha`)",
             write=_diffusers_metadata("h3", ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.net.2"]),
             reference="diffusers"),
        dict(name="qwen-diffusers-metadata", kind="qwen", layout="diffusers `save_lora_weights` with adapter metadata",
             alpha_from="header `lora_adapter_metadata` (`transformer.lora_alpha`)",
             write=_diffusers_metadata("qwen", ["transformer_blocks.0.attn.to_k",
                                                "transformer_blocks.0.txt_mlp.net.0.proj"]),
             reference="diffusers"),
        dict(name="qwen-diffsynth-default-infix", kind="qwen", layout="DiffSynth-Studio (`.lora_A.default.weight`)",
             alpha_from="none (alpha = rank)", write=_diffsynth_qwen, reference="diffusers"),
    ]
