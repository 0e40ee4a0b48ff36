"""Tensor-parallel parts through the diffusers entry points: ``lora_cache.load_lora`` and
``set_pipeline_adapters`` with ``shards=`` on a real Flux transformer (tiny config, loaded
by ``from_pretrained``), each rank's part equal to its part of a single-process merge."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from lora_cache.switching.diffusers_switch import set_pipeline_adapters  # noqa: E402
from lora_cache.ranks.tp_shards import Shard, ShardSpecError  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

DEGREE = 2
COLUMN = ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp"]  # rows: weight and bias
ROW = ["transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff.net.2"]  # columns: weight; bias whole


def spec(rank: int) -> dict:
    shards = {}
    for module in COLUMN:
        shards[f"{module}.weight"] = shards[f"{module}.bias"] = (0, rank, DEGREE)
    for module in ROW:
        shards[f"{module}.weight"] = (1, rank, DEGREE)
    return shards


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    """A tiny Flux transformer, a diffusers-format adapter for it, and the weights of its
    single-process merge (the reference every rank's part is held to)."""
    folder = tmp_path_factory.mktemp("tp-flux")
    model_folder = tm.save_model("flux", folder / "model")
    adapter = tm.write_adapters("flux", model_folder, folder)["diffusers_meta"]
    whole = tm.load_model("flux", model_folder)
    lora_cache.load_lora(whole, adapter, cache_root=folder / "single", weight_name="pytorch_lora_weights.safetensors",
                         progress=False)
    return {"model": model_folder, "adapter": adapter, "reference": tm.weights(whole),
            "base": tm.weights(tm.load_model("flux", model_folder))}


def rank_model(model_folder: str, rank: int):
    """The model as a rank holds it: the split parameters as their parts of the mapped
    checkpoint (rows at an offset of the whole, columns strided), the rest whole."""
    model = tm.load_model("flux", model_folder)
    parameters = dict(model.named_parameters())
    for name, part in spec(rank).items():
        module_name, attr = name.rsplit(".", 1)
        module = model.get_submodule(module_name)
        setattr(module, attr, nn.Parameter(Shard(*part).part(parameters[name].detach()), requires_grad=False))
    return model


def differ(model, expected: dict, rank: int) -> list[str]:
    """The parameters that are not their part of ``expected``."""
    parts = spec(rank)
    return [n for n, p in model.named_parameters()
            if not torch.equal(p, Shard(*parts[n]).part(expected[n]) if n in parts else expected[n])]


def test_load_lora_gives_each_rank_its_part_of_a_single_process_merge_and_hits_after(flux, tmp_path):
    cache = tmp_path / "cache"
    for rank in range(DEGREE):
        model = rank_model(flux["model"], rank)
        stats = lora_cache.load_lora(model, flux["adapter"], cache_root=cache, progress=False, shards=spec(rank),
                                     weight_name="pytorch_lora_weights.safetensors")
        assert stats.built > 0 and differ(model, flux["reference"], rank) == []
        assert list(stats.shard_keys) == [Shard(1, rank, DEGREE).describe()]  # the columns, merged apart
        again = rank_model(flux["model"], rank)
        second = lora_cache.load_lora(again, flux["adapter"], cache_root=cache, progress=False, shards=spec(rank),
                                      weight_name="pytorch_lora_weights.safetensors")
        assert (second.built, second.hit) == (0, second.layers) and second.shard_keys == stats.shard_keys
        assert differ(again, flux["reference"], rank) == []


def test_set_pipeline_adapters_switches_a_rank_to_its_parts_to_the_base_and_back_from_the_cache(flux, tmp_path):
    model, cache = rank_model(flux["model"], 1), tmp_path / "cache"
    options = dict(files={"turbo": flux["adapter"]}, cache_root=cache, weight_name="pytorch_lora_weights.safetensors",
                   shards=spec(1))
    first = set_pipeline_adapters(model, ["turbo"], [1.0], **options)
    assert first.mode == "built" and differ(model, flux["reference"], 1) == []
    assert set_pipeline_adapters(model, [], **options).mode == "base"
    assert differ(model, flux["base"], 1) == []
    back = set_pipeline_adapters(model, ["turbo"], [1.0], **options)
    assert back.mode == "cached" and back.layers == first.layers and differ(model, flux["reference"], 1) == []


def test_load_lora_refuses_a_part_named_as_a_module_before_merging(flux, tmp_path):
    model = rank_model(flux["model"], 0)
    with pytest.raises(ShardSpecError, match=r"names a module, not a parameter"):
        lora_cache.load_lora(model, flux["adapter"], cache_root=tmp_path / "cache", progress=False,
                             shards={"transformer_blocks.0.attn.to_q": (0, 0, DEGREE)},
                             weight_name="pytorch_lora_weights.safetensors")
    assert not lora_cache.is_merged(model) and not (tmp_path / "cache").exists()
