"""LyCORIS files in the original SD/SDXL UNet's names (SGM: ``input_blocks``, ``output_blocks``)
merge into a diffusers UNet as the same file in diffusers' names does.

The layout is held to diffusers' own single-file loader (``convert_ldm_unet_checkpoint``,
what ``from_single_file`` converts an original checkpoint with) on every parameter of a
tiny SD 1.x UNet and a tiny SDXL-shaped one; the rules made from it are held to that
layout, in kohya's and ComfyUI's spellings; and a LoHa, LoKr and Tucker LoCon file in those
names merges bit for bit as the same factors under diffusers' names do (which the
conformance corpus holds to LyCORIS's definition).
"""

from __future__ import annotations

import os

import pytest
import torch

from hostmem.safetensors.mapping import save_file
from lora_cache.adapters.key_names import KeyRule, ModuleIndex, resolve_stem
from lora_cache.adapters.sgm_names import _RESNET, _outside, layout, sgm_rules
from tests.conformance import models as cm
from tests.conformance.corpus_lycoris import _loha, _lokr, _tucker_locon
from tests.clients.test_sd_kohya import sd  # noqa: F401 (a fixture)
from tests.conftest import run_python, write_lora_config
from tests.fresh_fork import CLI, CLIENTS

diffusers = pytest.importorskip("diffusers")

SD = cm.UNET
SDXL = {"block_out_channels": (8, 16, 16), "layers_per_block": 2, "sample_size": 8, "in_channels": 4,
        "out_channels": 4, "norm_num_groups": 4, "cross_attention_dim": 16, "attention_head_dim": (2, 4, 4),
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "transformer_layers_per_block": (1, 2, 2), "use_linear_projection": True,
        "addition_embed_type": "text_time", "addition_time_embed_dim": 4,
        "projection_class_embeddings_input_dim": 4 * 6 + 16}  # SDXL's shape: label_emb, two-layer transformers
SD15 = {**SD, "block_out_channels": (8, 8, 16, 16), "layers_per_block": 2, "norm_num_groups": 4, "sample_size": 16,
        "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3}  # SD 1.5's: 12 input blocks, ids past 9
REFINER = {**SDXL, "block_out_channels": (8, 8, 16, 16), "attention_head_dim": 4, "transformer_layers_per_block": 1,
           "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
           "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D")}  # SDXL refiner's
CONFIGS = {"sd1": SD, "sd15": SD15, "sdxl": SDXL, "refiner": REFINER}


def _unet(config):
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(**config).eval()


def _original_names(model) -> dict[str, str]:
    """Every parameter of ``model`` -> its name in the original layout, by :func:`layout`."""
    found = {}
    prefixes = [(name, original, part) for original, name, part in layout(model.config)]
    prefixes += [(name, original, "module") for original, name in _outside(model.config).items()]
    renamed = {v: k for k, v in _RESNET.items()}
    for param in dict(model.named_parameters()):
        module, _, kind = param.rpartition(".")
        for name, original, part in prefixes:
            if part == "attention" and module.startswith(name + "."):
                found[param] = f"{original}.{module[len(name) + 1:]}.{kind}"
            elif part == "resnet" and module.rpartition(".")[0] == name and module.rpartition(".")[2] in renamed:
                found[param] = f"{original}.{renamed[module.rpartition('.')[2]]}.{kind}"
            elif part == "module" and module == name:
                found[param] = f"{original}.{kind}"
    return found


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_layout_is_the_one_diffusers_single_file_loader_converts(config):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint

    model = _unet(config)
    params = dict(model.named_parameters())
    original = _original_names(model)
    assert sorted(original) == sorted(params), "every parameter has an original name"
    checkpoint = {f"model.diffusion_model.{original[p]}": value for p, value in params.items()}
    converted = convert_ldm_unet_checkpoint(checkpoint, dict(model.config))
    assert sorted(converted) == sorted(params)
    wrong = [p for p, value in params.items() if not torch.equal(converted[p], value)]
    assert not wrong, f"diffusers puts these elsewhere: {wrong[:5]}"


@pytest.mark.parametrize("config", [*CONFIGS.values(), {**SD15, "layers_per_block": (1, 2, 2, 1)}],
                         ids=[*CONFIGS.keys(), "layers-listed"])
def test_every_original_name_resolves_to_its_module_in_both_spellings(config):
    model = _unet(config)
    index = ModuleIndex({n: tuple(p.shape) for n, p in model.named_parameters()})
    rules = [KeyRule.parse(r) for r in sgm_rules(model.config)]
    for param, original in _original_names(model).items():
        stem, module = original.rpartition(".")[0], param.rpartition(".")[0]
        for spelling in ("lora_unet_" + stem.replace(".", "_"), "diffusion_model." + stem):
            targets = resolve_stem(spelling, rules, index)
            assert targets is not None and [t.module for t in targets] == [module], (spelling, targets)


def test_a_unet_whose_block_types_are_not_described_gets_no_rules():
    from diffusers.loaders import StableDiffusionLoraLoaderMixin

    from lora_cache.adapters.family_rules import family_of

    assert sgm_rules({**SD, "down_block_types": ("SimpleCrossAttnDownBlock2D", "DownBlock2D")}) == ()
    assert sgm_rules({**SD, "mid_block_type": "UNetMidBlock2DSimpleCrossAttn"}) == ()
    assert family_of(StableDiffusionLoraLoaderMixin, _unet(SD)) is not None
    other = type("UNetControlNetXSModel", (torch.nn.Module,), {"config": dict(SD)})()  # its modules are named otherwise
    assert family_of(StableDiffusionLoraLoaderMixin, other) is None


_SGM = {  # the tiny SD UNet's modules in the original names (as kohya's SD 1.x tools write them)
    "down_blocks.0.resnets.0.conv1": "input_blocks.1.0.in_layers.2",
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q": "input_blocks.1.1.transformer_blocks.0.attn1.to_q",
    "down_blocks.0.downsamplers.0.conv": "input_blocks.2.0.op",
    "down_blocks.1.resnets.0.conv_shortcut": "input_blocks.3.0.skip_connection",
    "mid_block.attentions.0.proj_in": "middle_block.1.proj_in",
    "up_blocks.0.upsamplers.0.conv": "output_blocks.1.1.conv",
    "up_blocks.1.resnets.0.conv2": "output_blocks.2.0.out_layers.3",
    "time_embedding.linear_1": "time_embed.0",
}
_KINDS = [_loha, _lokr("whole", "pair", (4, 4)), _tucker_locon]


def _merged_alike(tmp_path, base: dict, files: dict, load, merge, weights, changed: set) -> None:
    """Each of ``files`` (name -> tensors) saved and merged by ``merge(model, path)`` (its
    stats) into a fresh ``load()``: each merges every layer of ``changed``, changes exactly
    those parameters of ``base``, and all leave the same weights, bit for bit."""
    merged = []
    for name, tensors in files.items():
        path = os.fspath(tmp_path / f"{name}.safetensors")
        save_file(tensors, path)
        model = load()
        assert merge(model, path).layers == len(changed)
        merged.append(weights(model))
    assert {k for k in base if not torch.equal(merged[0][k], base[k])} == changed
    assert all(torch.equal(one[k], merged[0][k]) for one in merged[1:] for k in base)


@pytest.mark.parametrize("spelling", ["kohya", "comfyui"])
def test_a_lycoris_file_in_the_original_names_merges_as_in_diffusers_names(tmp_path, spelling):
    import lora_cache

    folder = tmp_path / "unet"
    cm.save_model("unet", folder)
    base = cm.weights(cm.load_model("unet", folder))
    gen, ours, theirs = torch.Generator().manual_seed(5), {}, {}
    for n, (module, original) in enumerate(_SGM.items()):
        shape = tuple(base[f"{module}.weight"].shape)
        build = _KINDS[n % 3] if len(shape) == 4 and shape[2:] != (1, 1) else _KINDS[1] if shape[0] % 4 == 0 else _loha
        parts = build(gen, shape)
        stem = "lora_unet_" + original.replace(".", "_") if spelling == "kohya" else "diffusion_model." + original
        ours |= {f"lora_unet_{module.replace('.', '_')}.{p}": v for p, v in parts.items()}
        theirs |= {f"{stem}.{p}": v for p, v in parts.items()}
    base_file = os.fspath(folder / "diffusion_pytorch_model.safetensors")
    _merged_alike(tmp_path, base, {"diffusers-names": ours, "original-names": theirs}, lambda: cm.load_model("unet", folder),
                  lambda model, path: lora_cache.merge(model, [(path, 0.7)], os.fspath(tmp_path / "cache"),
                                                       base_files=[base_file], progress=False),
                  cm.weights, {f"{m}.weight" for m in _SGM})


def test_a_key_in_the_original_names_of_no_module_is_refused_naming_it(tmp_path):
    import lora_cache
    from lora_cache.adapters.key_names import KeyResolutionError
    from lora_cache.adapters.spec import AdapterError

    folder = tmp_path / "unet"
    cm.save_model("unet", folder)
    path = os.fspath(tmp_path / "far.safetensors")
    save_file({f"lora_unet_input_blocks_9_1_proj_in.{p}": v
               for p, v in _loha(torch.Generator().manual_seed(1), (32, 32)).items()}, path)
    with pytest.raises((KeyResolutionError, AdapterError), match="input_blocks_9_1_proj_in"):
        lora_cache.merge(cm.load_model("unet", folder), [path], os.fspath(tmp_path / "cache"),
                         base_files=[os.fspath(folder / "diffusion_pytorch_model.safetensors")], progress=False)


def test_an_image_built_by_the_cli_from_the_checkpoint_serves_the_unet(tmp_path):
    """``hostmem lora merge`` reads the file against the checkpoint as the server's UNet will
    (its config.json's class and config): the server's start hits every layer it built."""
    import json

    import lora_cache

    folder = tmp_path / "unet"
    cm.save_model("unet", folder)
    base = cm.weights(cm.load_model("unet", folder))
    gen, tensors = torch.Generator().manual_seed(9), {}
    for module, original in list(_SGM.items())[:4]:
        parts = _loha(gen, tuple(base[f"{module}.weight"].shape))
        tensors |= {f"lora_unet_{original.replace('.', '_')}.{p}": v for p, v in parts.items()}
    adapter = os.fspath(tmp_path / "sdxl-names.safetensors")
    save_file(tensors, adapter)
    config = write_lora_config(tmp_path, folder, adapter, strength=0.8, layers="down_blocks.{i}.", name="sgm-names")
    cli = run_python(CLI, "lora", "merge", config, "--json", timeout=300, forked_from=CLIENTS)
    assert cli.returncode == 0, cli.stderr
    built = json.loads(cli.stdout)
    assert built["built"] == built["layers"] == 4
    served = lora_cache.merge(cm.load_model("unet", folder), [(adapter, 0.8)], os.fspath(tmp_path / "cache"),
                              progress=False)
    assert (served.cache_key, served.hit, served.built) == (built["cache_key"], 4, 0)


def test_a_pipelines_unet_and_text_encoder_take_a_lycoris_file_in_the_original_names(sd, tmp_path):  # noqa: F811
    """``load_lora(pipe)``: the UNet's keys in the original names and the text encoder's
    kohya keys in one LoHa file merge as the same file in diffusers' names does."""
    import lora_cache
    from tests.clients.test_sd_kohya import _pipeline, _weights

    pipe = _pipeline(sd)
    base = {k: v for k, v in _weights(pipe).items()}
    gen, ours, theirs = torch.Generator().manual_seed(11), {}, {}
    modules = {**{f"unet.{m}": o for m, o in list(_SGM.items())[:3]},
               "text_encoder.encoder.layers.0.self_attn.q_proj": None}  # transformers 5: no text_model level
    for module, original in modules.items():
        parts = _loha(gen, tuple(base[f"{module}.weight"].shape))
        component, _, name = module.partition(".")
        kohya = "lora_te_text_model." + name if component == "text_encoder" else "lora_unet_" + name
        stem = kohya.replace(".", "_")
        ours |= {f"{stem}.{p}": v for p, v in parts.items()}
        theirs |= {f"{stem if original is None else 'lora_unet_' + original.replace('.', '_')}.{p}": v
                   for p, v in parts.items()}
    _merged_alike(tmp_path, base, {"diffusers-names": ours, "original-names": theirs}, lambda: _pipeline(sd),
                  lambda pipe, path: lora_cache.load_lora(pipe, path, 0.9, cache_root=os.fspath(tmp_path / "cache"),
                                                          progress=False),
                  _weights, {f"{m}.weight" for m in modules})


def test_a_plain_lora_in_the_original_names_diffusers_cannot_convert_merges_by_the_rules(tmp_path):
    """diffusers' SGM mapping takes ``input_blocks_1`` for a prefix of ``input_blocks_10``
    (SD 1.5 has 12 input blocks) and puts SD 1.x's upsampler on an attention: such a plain
    LoRA was refused. Its conversion refused, the file is read by the rules, and merges as
    the same factors under diffusers' names (alpha = rank: no scale folded)."""
    import lora_cache

    folder = tmp_path / "unet"
    _unet(SD15).save_pretrained(folder)
    base = dict(diffusers.UNet2DConditionModel.from_pretrained(folder).state_dict())
    modules = {"down_blocks.3.resnets.1.conv2": "input_blocks.11.0.out_layers.3",
               "down_blocks.2.downsamplers.0.conv": "input_blocks.9.0.op",
               "down_blocks.0.attentions.1.transformer_blocks.0.attn2.to_k":
                   "input_blocks.2.1.transformer_blocks.0.attn2.to_k",
               "up_blocks.0.upsamplers.0.conv": "output_blocks.2.1.conv"}
    gen, ours, theirs = torch.Generator().manual_seed(13), {}, {}
    for module, original in modules.items():
        weight = base[f"{module}.weight"]
        down = torch.randn(4, weight[0].numel(), generator=gen) * 0.1
        up = torch.randn(weight.shape[0], 4, generator=gen) * 0.05
        kernel = [1] * (weight.dim() - 2)  # a conv's pair: down (4, in, kh, kw), up (out, 4, 1, 1)
        pair = {"lora_down.weight": down.reshape(4, *weight.shape[1:]), "lora_up.weight": up.reshape(-1, 4, *kernel),
                "alpha": torch.tensor(4.0)}
        ours |= {f"lora_unet_{module.replace('.', '_')}.{p}": v for p, v in pair.items()}
        theirs |= {f"lora_unet_{original.replace('.', '_')}.{p}": v for p, v in pair.items()}
    _merged_alike(tmp_path, base, {"diffusers-names": ours, "original-names": theirs},
                  lambda: diffusers.UNet2DConditionModel.from_pretrained(folder),
                  lambda model, path: lora_cache.merge(model, [(path, 0.6)], os.fspath(tmp_path / "cache"), progress=False),
                  lambda model: dict(model.state_dict()), {f"{m}.weight" for m in modules})


@pytest.mark.parametrize("spelling", ["kohya", "comfyui"])
def test_full_diffs_in_the_original_names_merge_on_an_sdxl_unet(tmp_path, spelling):
    """Full weight differences (``.diff``, ``.diff_b``) on an SDXL UNet, in the original names
    and in the UNet's own (LyCORIS's full algorithm through kohya, ``lora_unet_down_blocks_…``):
    diffusers' single-file converter, which placed them, fails on a partial SDXL checkpoint
    (it reads ``label_emb`` first) and names no diffusers name, and they were refused. The
    rules place them: ``W + strength * diff``, as ComfyUI adds them."""
    import lora_cache

    folder = tmp_path / "unet"
    _unet(SDXL).save_pretrained(folder)
    base = dict(diffusers.UNet2DConditionModel.from_pretrained(folder).state_dict())
    modules = {"down_blocks.1.attentions.0.proj_in": "input_blocks.4.1.proj_in",
               "down_blocks.2.resnets.1.conv1": "input_blocks.8.0.in_layers.2",
               "up_blocks.0.upsamplers.0.conv": "output_blocks.2.2.conv",
               "add_embedding.linear_1": "label_emb.0.0",
               "down_blocks.1.resnets.0.conv2": None, "up_blocks.1.attentions.0.proj_out": None}  # its own names
    gen, tensors, expected = torch.Generator().manual_seed(17), {}, {}
    for module, original in modules.items():
        name = module if original is None else original
        stem = "lora_unet_" + name.replace(".", "_") if spelling == "kohya" else "diffusion_model." + name
        for kind, suffix in (("weight", "diff"), ("bias", "diff_b")):
            diff = torch.randn(base[f"{module}.{kind}"].shape, generator=gen) * 1e-3
            tensors[f"{stem}.{suffix}"] = diff
            expected[f"{module}.{kind}"] = base[f"{module}.{kind}"] + 0.7 * diff
    path = os.fspath(tmp_path / "diffs.safetensors")
    save_file(tensors, path)
    model = diffusers.UNet2DConditionModel.from_pretrained(folder)
    lora_cache.merge(model, [(path, 0.7)], os.fspath(tmp_path / "cache"), progress=False)
    merged = dict(model.state_dict())
    assert {k for k in base if not torch.equal(merged[k], base[k])} == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=2 * torch.finfo(torch.float32).eps
                                   * float(value.abs().max()))


def test_a_diff_b_beside_a_kohya_pair_on_a_unet_is_the_bias_diff(tmp_path):
    """As ComfyUI merges it: the pair changes the weight, ``.diff_b`` the bias by ``strength * diff_b``."""
    import lora_cache

    folder = tmp_path / "unet"
    cm.save_model("unet", folder)
    base = cm.weights(cm.load_model("unet", folder))
    module = "down_blocks.0.attentions.0.proj_in"
    weight, bias = base[f"{module}.weight"], base[f"{module}.bias"]
    gen = torch.Generator().manual_seed(19)
    down, up = torch.randn(4, weight.shape[1], generator=gen) * 0.1, torch.randn(weight.shape[0], 4, generator=gen) * 0.1
    diff_b, stem = torch.randn(bias.shape, generator=gen) * 1e-3, "lora_unet_" + module.replace(".", "_")
    kernel = [1] * (weight.dim() - 2)
    path = os.fspath(tmp_path / "pair-and-bias.safetensors")
    save_file({f"{stem}.lora_down.weight": down.reshape(4, *weight.shape[1:]), f"{stem}.alpha": torch.tensor(4.0),
               f"{stem}.lora_up.weight": up.reshape(-1, 4, *kernel), f"{stem}.diff_b": diff_b}, path)
    model = cm.load_model("unet", folder)
    lora_cache.merge(model, [(path, 0.5)], os.fspath(tmp_path / "cache"), progress=False,
                     base_files=[os.fspath(folder / "diffusion_pytorch_model.safetensors")])
    merged = cm.weights(model)
    ulp = torch.finfo(torch.float32).eps
    torch.testing.assert_close(merged[f"{module}.bias"], bias + 0.5 * diff_b, rtol=0, atol=2 * ulp * float(bias.abs().max()))
    torch.testing.assert_close(merged[f"{module}.weight"], weight + 0.5 * (up @ down).reshape(weight.shape), rtol=0,
                               atol=4 * ulp * float(weight.abs().max()))
