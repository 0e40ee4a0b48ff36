"""Every key of an adapter file accounted for: a key diffusers' converter drops, or one for a
component the pipeline lacks, fails the load naming it (``strict=False``: one warning naming
how many and the first few, and the rest applies); a key the reader once refused though
diffusers loads it (diffusers' older SD attention-processor layout) is now read."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="the converters held to the rule are diffusers'")
pytest.importorskip("peft", reason="the SD pipeline's LoRA loading needs peft (pip install hostmem[test])")
pytest.importorskip("transformers", reason="the text encoder needs transformers (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from lora_cache.adapters.diffusers_format import read_with_diffusers  # noqa: E402
from tests.clients.test_kohya_fallback import _bfl_sizes, _kohya  # noqa: E402
from tests.clients.test_sd_kohya import _kohya_file, sd  # noqa: E402,F401


def _without_text_encoder(root):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    return StableDiffusionPipeline(
        vae=None, text_encoder=None, tokenizer=None, unet=UNet2DConditionModel.from_pretrained(root / "unet"),
        scheduler=None, safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )


def test_lora_te_keys_into_a_pipeline_without_a_text_encoder_are_named_not_skipped(sd, tmp_path):  # noqa: F811
    path = _kohya_file(sd, tmp_path / "kohya_sd.safetensors", alpha=2.0)
    pipe = _without_text_encoder(sd)
    with pytest.raises(lora_cache.AdapterError, match=r"kohya_sd.safetensors: \d+ key\(s\) change text_encoder, which "
                                                      r"the pipeline lacks \(it has unet\): text_encoder\..*strict=False"):
        lora_cache.load_lora(pipe, path, enabled=False, progress=False)
    with pytest.warns(UserWarning, match=r"key\(s\) change text_encoder, which the pipeline lacks.*strict=False, so "
                                         r"the rest is merged") as caught:
        stats = lora_cache.load_lora(pipe, lora_cache.Adapter(path, strict=False), enabled=False, progress=False)
    assert len([w for w in caught if "text_encoder" in str(w.message)]) == 1  # one warning, not one per key
    assert stats.layers == sum(1 for k in _keys(path) if k.startswith("lora_unet_") and k.endswith("down.weight"))


def test_a_start_planned_from_the_conversion_record_names_the_same_keys(sd, tmp_path):  # noqa: F811
    """The record of a conversion keeps what was left over: a later start, planned from it
    without converting, warns or refuses as the first did (a UNet merged alone first, then
    the pipeline that lacks the text encoder)."""
    from diffusers import UNet2DConditionModel

    path = _kohya_file(sd, tmp_path / "kohya_sd.safetensors", alpha=2.0)
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match=r"change text_encoder, which is not the model merged into"):
        lora_cache.merge(UNet2DConditionModel.from_pretrained(sd / "unet"), path, cache_root=cache, progress=False)
    with pytest.raises(lora_cache.AdapterError, match=r"change text_encoder, which the pipeline lacks"):
        lora_cache.load_lora(_without_text_encoder(sd), path, cache_root=cache, progress=False)
    with pytest.warns(UserWarning, match=r"change text_encoder, which the pipeline lacks"):
        stats = lora_cache.load_lora(_without_text_encoder(sd), lora_cache.Adapter(path, strict=False),
                                     cache_root=cache, progress=False)
    assert stats.layers > 0


def _keys(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(path, "pt") as handle:
        return list(handle.keys())


def test_a_unet_merged_alone_names_the_text_encoder_keys_it_leaves(sd, tmp_path):  # noqa: F811
    from diffusers import UNet2DConditionModel

    path = _kohya_file(sd, tmp_path / "kohya_sd.safetensors", alpha=2.0)
    unet = UNet2DConditionModel.from_pretrained(sd / "unet")
    with pytest.warns(UserWarning, match=r"change text_encoder, which is not the model merged into \(it has unet\)"):
        lora_cache.merge(unet, path, enabled=False, progress=False)


@pytest.fixture
def flux_dev_with_t5(tmp_path):
    """A kohya Flux file at Flux-dev's widths with a T5 LoRA, which diffusers' converter filters out."""
    dim = 3072
    path = _kohya(tmp_path / "dev.safetensors", _bfl_sizes(dim, 4 * dim, extra=False))
    from safetensors.torch import load_file

    tensors = load_file(path)
    gen = torch.Generator().manual_seed(2)
    stem = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q"
    tensors[f"{stem}.lora_down.weight"] = torch.randn(4, 64, generator=gen)
    tensors[f"{stem}.lora_up.weight"] = torch.randn(64, 4, generator=gen)
    save_file(tensors, path)
    return os.fspath(path), stem


def test_keys_diffusers_converter_drops_are_named(flux_dev_with_t5):
    path, stem = flux_dev_with_t5
    with pytest.raises(lora_cache.AdapterError, match=rf"2 key\(s\) are dropped by diffusers' FluxPipeline.lora_state_dict"
                                                      rf" \(it merges nothing of them\): {stem}.lora_down.weight"):
        read_with_diffusers(path, diffusers.FluxPipeline)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter = read_with_diffusers(path, diffusers.FluxPipeline, strict=False)
    assert [str(w.message) for w in caught if "dropped by" in str(w.message)] and adapter.modules


def test_the_older_diffusers_sd_layout_merges_as_diffusers_loads_it(sd, tmp_path):  # noqa: F811
    """``unet.….processor.to_q_lora.down.weight`` (diffusers' attention-processor layout): the
    reader groups its parts, diffusers renames them to peft's, and the merge is diffusers'."""
    from tests.clients.test_sd_kohya import _changed_as_in, _diffusers_fused, _pipeline, _weights

    gen, tensors = torch.Generator().manual_seed(21), {}
    block = "unet.down_blocks.0.attentions.0.transformer_blocks.0"
    for attn, proj, width in (("attn1", "to_q", 32), ("attn2", "to_k", 32), ("attn1", "to_out", 32)):
        stem = f"{block}.{attn}.processor.{proj}_lora"
        tensors[f"{stem}.down.weight"] = torch.randn(4, width, generator=gen) / width**0.5
        tensors[f"{stem}.up.weight"] = torch.randn(32, 4, generator=gen)
    path = os.fspath(tmp_path / "older.safetensors")
    save_file(tensors, path)
    reference = _weights(_diffusers_fused(sd, path))
    pipe = _pipeline(sd)
    stats = lora_cache.load_lora(pipe, path, enabled=False, progress=False)
    assert stats.layers == len(_changed_as_in(_weights(pipe), reference, sd)) == 3
