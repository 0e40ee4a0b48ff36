"""SD 1.x/SDXL LoRAs as their users have them: kohya sd-scripts files (``lora_unet_...``,
``lora_te_...``, an alpha per module) and text-encoder LoRAs written before transformers
flattened ``CLIPTextModel`` (``text_encoder.text_model.encoder...``). diffusers loads
both; the cache merges them to diffusers' ``load_lora_weights`` + ``fuse_lora``."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")
pytest.importorskip("transformers", reason="the text encoder needs transformers (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402

RANK = 4
UNET = {"block_out_channels": (32, 64), "layers_per_block": 1, "sample_size": 16, "in_channels": 4, "out_channels": 4,
        "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"), "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
        "cross_attention_dim": 32, "norm_num_groups": 8, "attention_head_dim": 4}
CLIP = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
        "max_position_embeddings": 16}


@pytest.fixture(scope="module")
def sd(tmp_path_factory):
    """A tiny SD UNet and CLIP text encoder, saved as users load them."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    root = tmp_path_factory.mktemp("sd")
    torch.manual_seed(0)
    UNet2DConditionModel(**UNET).save_pretrained(root / "unet")
    CLIPTextModel(CLIPTextConfig(**CLIP)).save_pretrained(root / "text_encoder")
    return root


def _pipeline(root):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    return StableDiffusionPipeline(
        vae=None, text_encoder=CLIPTextModel.from_pretrained(root / "text_encoder"), tokenizer=None,
        unet=UNet2DConditionModel.from_pretrained(root / "unet"), scheduler=None, safety_checker=None,
        feature_extractor=None, requires_safety_checker=False,
    )


def _base_files(root) -> list[str]:
    return [os.fspath(p) for component in ("unet", "text_encoder") for p in (root / component).glob("*.safetensors")]


def _weights(pipe) -> dict[str, torch.Tensor]:
    out = {}
    for component in ("unet", "text_encoder"):
        for name, value in getattr(pipe, component).state_dict().items():
            if "lora_" not in name:
                out[f"{component}.{name.replace('.base_layer', '')}"] = value.detach().clone()
    return out


def _kohya_file(root, path, alpha: float) -> str:
    """A kohya sd-scripts LoRA on the UNet's attention, projections and feed-forward and the
    text encoder's attention and MLP: diffusers' own convert_state_dict_to_kohya of a peft LoRA."""
    from diffusers.utils import convert_state_dict_to_kohya
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    pipe = _pipeline(root)
    torch.manual_seed(3)
    layers = {}
    for component, targets in (("unet", ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2"]),
                               ("text_encoder", ["q_proj", "k_proj", "v_proj", "out_proj", "fc1"])):
        model = get_peft_model(getattr(pipe, component), LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets,
                                                                    init_lora_weights=False))
        layers.update({f"{component}.{k.removeprefix('base_model.model.')}": v
                       for k, v in get_peft_model_state_dict(model).items()})
    kohya = {}
    for key, value in convert_state_dict_to_kohya(layers).items():
        if key.startswith("lora_te1_"):  # diffusers writes SDXL's name; SD 1.x files from sd-scripts have this one
            key = key.replace("lora_te1_", "lora_te_text_model_", 1)
        kohya[key] = torch.tensor(alpha) if key.endswith(".alpha") else value.contiguous()
    assert any(k.startswith("lora_te_text_model_encoder_") for k in kohya) and any(k.startswith("lora_unet_") for k in kohya)
    save_file(kohya, os.fspath(path))
    return os.fspath(path)


def _diffusers_fused(root, adapter: str):
    pipe = _pipeline(root)
    pipe.load_lora_weights(adapter)
    pipe.fuse_lora()
    return pipe


def _changed_as_in(ours: dict, reference: dict, root) -> list[str]:
    """Every weight within fp32 rounding of diffusers'; the names of those the LoRA changed."""
    assert ours.keys() == reference.keys()
    for name, ref in reference.items():
        torch.testing.assert_close(ours[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)
    base = _weights(_pipeline(root))
    return [n for n in ours if not torch.equal(ours[n], base[n])]


@pytest.fixture
def kohya(sd, tmp_path):
    (tmp_path / "adapters").mkdir()
    return _kohya_file(sd, tmp_path / "adapters" / "kohya_sd.safetensors", alpha=2.0)


def test_a_kohya_sd_lora_merges_into_unet_and_text_encoder_as_diffusers_fuses_it(sd, kohya, tmp_path):
    reference = _weights(_diffusers_fused(sd, kohya))
    pipe = _pipeline(sd)
    stats = lora_cache.load_lora(pipe, kohya, cache_root=tmp_path / "cache", base_files=_base_files(sd), progress=False)
    changed = _changed_as_in(_weights(pipe), reference, sd)
    assert stats.built == stats.layers == len(changed)
    assert any(n.startswith("unet.") and ".attn1.to_out.0." in n for n in changed)  # kohya's to_out_0
    assert any(n.startswith("text_encoder.") and ".self_attn.q_proj." in n for n in changed)
    again = _pipeline(sd)
    hit = lora_cache.load_lora(again, kohya, cache_root=tmp_path / "cache", base_files=_base_files(sd), progress=False)
    assert (hit.hit, hit.built) == (stats.layers, 0)
    assert all(torch.equal(a, b) for a, b in zip(_weights(again).values(), _weights(pipe).values()))


def test_each_kohya_module_takes_its_own_alpha(sd, kohya, tmp_path):
    """One module's alpha changed in the file: that module's delta follows it (scale alpha / rank,
    as kohya's trainer and ComfyUI apply it), the others keep theirs."""
    from safetensors.torch import load_file

    from diffusers import UNet2DConditionModel

    tensors = load_file(kohya)
    stem = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
    tensors[f"{stem}.alpha"] = torch.tensor(3.0)
    save_file(tensors, os.fspath(tmp_path / "one_alpha.safetensors"))
    unet = UNet2DConditionModel.from_pretrained(sd / "unet")
    base = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight.detach().clone()
    lora_cache.merge(unet, os.fspath(tmp_path / "one_alpha.safetensors"), enabled=False, progress=False)
    up, down = tensors[f"{stem}.lora_up.weight"], tensors[f"{stem}.lora_down.weight"]
    expected = base + (3.0 / RANK) * (up.float() @ down.float())
    torch.testing.assert_close(unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q.weight, expected,
                               rtol=1e-6, atol=1e-6)
    stem_k = stem.replace("to_q", "to_k")
    base_k = UNet2DConditionModel.from_pretrained(sd / "unet").down_blocks[0].attentions[0].transformer_blocks[0].attn1
    expected_k = base_k.to_k.weight + (2.0 / RANK) * (tensors[f"{stem_k}.lora_up.weight"] @ tensors[f"{stem_k}.lora_down.weight"])
    torch.testing.assert_close(unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_k.weight, expected_k,
                               rtol=1e-6, atol=1e-6)


def test_a_text_encoder_lora_with_the_text_model_level_merges_as_diffusers_fuses_it(sd, tmp_path):
    torch.manual_seed(5)
    prefix = "text_encoder.text_model.encoder.layers"
    lora = {}
    for layer in range(2):
        for module, (rows, cols) in (("self_attn.q_proj", (32, 32)), ("mlp.fc2", (32, 64))):
            lora[f"{prefix}.{layer}.{module}.lora_A.weight"] = torch.randn(RANK, cols)
            lora[f"{prefix}.{layer}.{module}.lora_B.weight"] = torch.randn(rows, RANK)
    adapter = os.fspath(tmp_path / "te_lora.safetensors")
    save_file(lora, adapter)
    reference = _weights(_diffusers_fused(sd, adapter))
    pipe = _pipeline(sd)
    stats = lora_cache.load_lora(pipe, adapter, cache_root=tmp_path / "cache", base_files=_base_files(sd), progress=False)
    changed = _changed_as_in(_weights(pipe), reference, sd)
    assert stats.built == stats.layers == len(changed) == 4


def test_only_the_merged_components_keys_are_renamed_and_what_diffusers_refuses_is_named(sd, kohya, tmp_path):
    """The file's text-encoder part holds only q_proj, which diffusers' renaming cannot place
    (its own pipeline loader refuses the file for it). Merged into the UNet alone, the
    text encoder's keys are not this merge's concern; into the pipeline, the error names it."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(kohya).items()
               if not k.startswith("lora_te_") or k.startswith("lora_te_text_model_encoder_layers_0_self_attn_q_proj")}
    partial = os.fspath(tmp_path / "partial.safetensors")
    save_file(tensors, partial)
    with pytest.raises(ValueError):
        _diffusers_fused(sd, partial)  # diffusers' own loader
    unet = UNet2DConditionModel.from_pretrained(sd / "unet")
    stats = lora_cache.merge(unet, partial, enabled=False, progress=False)
    assert stats.layers == sum(1 for k in tensors if k.startswith("lora_unet_") and k.endswith(".lora_down.weight"))
    with pytest.raises(lora_cache.AdapterError, match=r"partial.safetensors: diffusers cannot rename the "
                                                       r"text_encoder keys to peft's \(.*\); diffusers' own loader"):
        lora_cache.load_lora(_pipeline(sd), partial, enabled=False, progress=False)


def test_a_component_in_peft_keys_keeps_its_keys_and_alphas_exactly():
    """What converted before this renaming existed converts to the same keys (so the same
    conversion records and cache keys); a module's two alphas that differ are an error."""
    from lora_cache.adapters.diffusers_keys import peft_keys

    down, up = torch.zeros(2, 8), torch.zeros(8, 2)
    state = {"transformer.a.to_q.lora_A.weight": down, "transformer.a.to_q.lora_B.weight": up}
    alphas = {"transformer.a.alpha": 3.0, "transformer.a.to_q.alpha": 2.0}
    out = peft_keys("x.safetensors", state, alphas)
    assert set(out) == {*state, *alphas} and float(out["transformer.a.alpha"]) == 3.0
    old = {"unet.a.to_q.lora.down.weight": down, "unet.a.to_q.lora.up.weight": up}
    with pytest.raises(lora_cache.AdapterError, match=r"two alphas for unet.a.to_q \(.*2.0 against 3.0\)"):
        peft_keys("x.safetensors", old, {"unet.a.to_q.alpha": 2.0, "unet.a.to_q.lora.down.weight.alpha": 3.0})
