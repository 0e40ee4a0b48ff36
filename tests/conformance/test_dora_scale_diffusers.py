"""A kohya SD file whose LoRA pairs carry LyCORIS's ``dora_scale``, on a diffusers pipeline:
diffusers' SD loader filters the ``dora_scale`` keys out (with a warning) and merges plain
LoRA. Those keys are held to the rule every key is: the load fails naming them; with
``strict=False`` one warning names them and the merge is diffusers' own load + fuse; with
``convert="native"`` the file merges as ComfyUI merges it (tests/lora_cache/test_lycoris.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the reference is diffusers' own load + fuse")
pytest.importorskip("peft", reason="the SD pipeline's LoRA loading needs peft (pip install hostmem[test])")
pytest.importorskip("transformers", reason="the text encoder needs transformers (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from tests.clients.test_sd_kohya import sd  # noqa: E402,F401

_BLOCK = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0"


def _dora_file(path, on_out: bool) -> str:
    gen, tensors = torch.Generator().manual_seed(37), {}
    for module in ("attn1_to_q", "attn1_to_v", "ff_net_2"):
        rows, cols = (32, 32) if module.startswith("attn") else (32, 128)
        stem = f"{_BLOCK}_{module}"
        tensors[f"{stem}.lora_down.weight"] = torch.randn(4, cols, generator=gen) / cols**0.5
        tensors[f"{stem}.lora_up.weight"] = torch.randn(rows, 4, generator=gen) * 0.2
        tensors[f"{stem}.alpha"] = torch.tensor(2.0)
        tensors[f"{stem}.dora_scale"] = 0.5 + torch.rand((rows, 1) if on_out else (1, cols), generator=gen)
    save_file(tensors, os.fspath(path))
    return os.fspath(path)


@pytest.mark.parametrize("on_out", [True, False], ids=["output-axis", "input-axis"])
def test_dora_scales_diffusers_drops_are_named_and_strict_false_merges_as_diffusers(sd, tmp_path, on_out):  # noqa: F811
    from tests.clients.test_sd_kohya import _changed_as_in, _diffusers_fused, _pipeline, _weights

    path = _dora_file(tmp_path / "dora.safetensors", on_out)
    with pytest.raises(lora_cache.AdapterError, match=r"3 key\(s\) are dropped by diffusers.*\.dora_scale"):
        lora_cache.load_lora(_pipeline(sd), path, enabled=False, progress=False)
    reference = _weights(_diffusers_fused(sd, path))
    pipe = _pipeline(sd)
    with pytest.warns(UserWarning, match=r"3 key\(s\) are dropped by diffusers.*dora_scale.*strict=False"):
        stats = lora_cache.load_lora(pipe, lora_cache.Adapter(path, strict=False), enabled=False, progress=False)
    assert stats.layers == len(_changed_as_in(_weights(pipe), reference, sd)) == 3
