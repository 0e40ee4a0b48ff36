"""Flux full diffs in BFL names that cannot be placed exactly are refused, naming the key
and why: a fused diff whose rows do not add up to its split weights, a bias diff on a
norm scale (which has no bias), a module the model lacks."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="Flux full diffs need diffusers (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from lora_cache import AdapterError  # noqa: E402
from tests.conformance import models  # noqa: E402


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return models.save_model("flux", tmp_path_factory.mktemp("flux") / "model")


@pytest.mark.parametrize("key, shape, why", [
    ("diffusion_model.double_blocks.0.img_attn.qkv.diff", (95, 32),
     r"95 rows where .*to_q.*to_k.*to_v have 32 \+ 32 \+ 32"),
    ("diffusion_model.single_blocks.0.linear1.diff", (224, 31), r"shape \(224, 31\) does not fit"),
    ("diffusion_model.double_blocks.0.img_attn.norm.query_norm.scale.diff_b", (16,),
     r"the model has no transformer_blocks\.0\.attn\.norm_q\.bias"),
    ("diffusion_model.double_blocks.3.img_attn.proj.diff", (32, 32), r"transformer_blocks\.3\.attn\.to_out\.0, which "
                                                                     r"the model lacks"),
], ids=["fused-rows", "columns", "bias-of-a-norm", "block-the-model-lacks"])
def test_a_diff_that_does_not_fit_is_refused_naming_it(flux_folder, tmp_path, key, shape, why):
    path = os.fspath(tmp_path / "diffs.safetensors")
    save_file({key: torch.ones(shape)}, path)
    model = models.load_model("flux", flux_folder)
    before = models.weights(model)
    with pytest.raises(AdapterError, match=rf"(?s){key.replace('.', '[.]')}.*{why}"):
        lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
    assert all(torch.equal(w, before[n]) for n, w in models.weights(model).items())


def test_a_bias_diff_a_converter_drops_beside_factors_is_named(tmp_path):
    """Read for no model (so no rules place its diffs), a ComfyUI Flux file's ``.diff_b`` beside
    a LoRA pair goes to diffusers' converter as peft's ``lora_B.bias``, which Flux's drops while
    keeping the pair: the load fails naming the key rather than merging without it."""
    from diffusers.loaders import FluxLoraLoaderMixin

    from lora_cache.adapters.diffusers_format import read_with_diffusers

    stem, gen = "diffusion_model.double_blocks.0.img_attn.proj", torch.Generator().manual_seed(2)
    path = os.fspath(tmp_path / "bias.safetensors")
    save_file({f"{stem}.lora_down.weight": torch.randn(4, 32, generator=gen),
               f"{stem}.lora_up.weight": torch.randn(32, 4, generator=gen), f"{stem}.diff_b": torch.randn(32)}, path)
    dropped = r"dropped by diffusers' FluxLoraLoaderMixin.*: diffusion_model\.double_blocks\.0\.img_attn\.proj\.diff_b"
    with pytest.raises(AdapterError, match=dropped):
        read_with_diffusers(path, FluxLoraLoaderMixin)


def test_a_diff_in_kohya_s_spelling_of_a_bfl_name_is_cut_as_comfyui_s(flux_folder, tmp_path):
    """ComfyUI also keys a BFL weight as kohya spells it (``lora_unet_double_blocks_0_img_attn_qkv``):
    the same table places that diff, its rows cut onto to_q, to_k and to_v."""
    diff = torch.randn(96, 32, generator=torch.Generator().manual_seed(3))
    path = os.fspath(tmp_path / "kohya_diff.safetensors")
    save_file({"lora_unet_double_blocks_0_img_attn_qkv.diff": diff}, path)
    model = models.load_model("flux", flux_folder)
    before = models.weights(model)
    stats = lora_cache.load_lora(model, lora_cache.Adapter(path, strength=0.5), cache_root=tmp_path / "cache",
                                 progress=False)
    after = models.weights(model)
    assert stats.layers == 3
    for part, rows in zip("qkv", diff.chunk(3)):
        name = f"transformer_blocks.0.attn.to_{part}.weight"
        torch.testing.assert_close(after[name], before[name] + 0.5 * rows, rtol=1e-6, atol=1e-6)
