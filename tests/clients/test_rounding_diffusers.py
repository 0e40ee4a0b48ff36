"""A sub-ulp layer in a diffusers adapter: the second start plans from the conversion record
and the rounding record (no measure, no conversion up front), and still serves the lossy
layer at run time with the adapter's real factors, exactly as the first start did."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

LOSSY = "transformer_blocks.0.attn.to_q"


def _adapter(model_folder, out) -> str:
    """A peft LoRA saved by diffusers, whose ``to_q`` update sits far below a bf16 step."""
    from peft import LoraConfig, get_peft_model
    from peft.utils import get_peft_model_state_dict

    config = LoraConfig(r=tm.RANK, lora_alpha=tm.RANK, target_modules=tm.TARGETS["flux"], init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = get_peft_model(tm.load_model("flux", model_folder), config)
    layers = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(peft_model).items()}
    up = f"{LOSSY}.lora_B.weight"
    layers[up] = torch.full_like(layers[up], 1e-6)  # coherent along each row: the output moves, the weight cannot
    _, pipe_cls = tm.classes("flux")
    pipe_cls.save_lora_weights(out, transformer_lora_layers=layers)
    return os.path.join(out, "pytorch_lora_weights.safetensors")


@torch.no_grad()
def _forward(model) -> torch.Tensor:
    feed = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tm.inputs("flux").items()}
    return model(**feed, return_dict=False)[0]


def test_a_lossy_layer_planned_from_records_is_served_with_its_real_factors(tmp_path):
    folder = tm.save_model("flux", tmp_path / "model", dtype=torch.bfloat16)
    path = _adapter(folder, tmp_path / "lora")
    cache = tmp_path / "cache"
    first = tm.load_model("flux", folder, torch.bfloat16)
    with pytest.warns(UserWarning, match="kept at run time"):
        built = lora_cache.load_lora(first, [path], cache_root=cache, progress=False)
    assert f"{LOSSY}.weight" in built.rounding["at_runtime"] and built.rounding["recorded"] is False
    assert os.listdir(cache / "lora_merge_cache" / "conversions")  # the next start plans from this record
    second = tm.load_model("flux", folder, torch.bfloat16)
    with pytest.warns(UserWarning, match="kept at run time"):
        stats = lora_cache.load_lora(second, [path], cache_root=cache, progress=False)
    assert stats.rounding["recorded"] is True and stats.rounding["at_runtime"] == built.rounding["at_runtime"]
    assert (stats.hit, stats.built, stats.at_runtime, stats.bytes_written) == (built.built, 0, built.at_runtime, 0)
    assert torch.equal(_forward(second), _forward(first))
    base = tm.load_model("flux", folder, torch.bfloat16)
    assert not torch.equal(_forward(second), _forward(base))
