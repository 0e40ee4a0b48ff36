"""LoRAs on fused projections: one fused LoRA onto separate weights, separate LoRAs onto one fused weight."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lora_cache
from lora_cache import Adapter, KeyResolutionError
from lora_cache.orchestrate import plan_targets
from tests.lora_cache.test_adapters import lora_change, mapped_model, reference_merge, write_adapter

_SPLIT = (r"^diffusion_model\.blocks\.(\d+)\.attn\.qkv$",
          [r"blocks.\1.attn.to_q", r"blocks.\1.attn.to_k", r"blocks.\1.attn.to_v"])


class FusedBlock(nn.Module):
    """Attention with one fused qkv projection (as BFL's Flux and many DiTs have)."""

    def __init__(self, dim: int):
        super().__init__()
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim)


class FusedDiT(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(FusedBlock(dim) for _ in range(depth))


def test_a_fused_qkv_lora_splits_by_rows_onto_separate_weights(tmp_path):
    model = mapped_model(tmp_path)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    fused = lora_change(192, 64, 8, 1, alpha=4)
    fused["diff_b"] = torch.randn(192)
    path = write_adapter(tmp_path / "qkv.safetensors", "comfyui", {"blocks.1.attn.qkv": fused})
    spec = Adapter(path, strength=0.75, rules=[_SPLIT])
    targets, _ = plan_targets(model, [spec])
    ups = {t.name: t.deltas[0].up for t in targets if t.name.endswith("weight")}
    mapped = targets[0].deltas[0].up.untyped_storage().data_ptr()
    assert all(up.untyped_storage().data_ptr() == mapped for up in ups.values())  # views of the file, no copy
    stats = lora_cache.merge(model, [spec], cache_root=tmp_path / "cache", progress=False)
    assert stats.layers == 6 and stats.built == 6
    for i, letter in enumerate("qkv"):
        rows = slice(64 * i, 64 * (i + 1))
        name = f"blocks.1.attn.to_{letter}"
        part = {"up": fused["up"][rows], "down": fused["down"]}
        expected = reference_merge(base[f"{name}.weight"], [(0.75 * 4 / 8, part)])
        torch.testing.assert_close(model.get_parameter(f"{name}.weight").double(), expected, rtol=1e-6, atol=1e-6)
        expected_bias = base[f"{name}.bias"].double() + 0.75 * fused["diff_b"][rows].double()
        torch.testing.assert_close(model.get_parameter(f"{name}.bias").double(), expected_bias, rtol=1e-6, atol=1e-6)


def test_separate_q_k_v_loras_land_on_their_rows_of_one_fused_weight(tmp_path):
    model = mapped_model(tmp_path, module=FusedDiT())
    base = model.blocks[0].attn.qkv.weight.detach().clone()
    changes = {f"blocks.0.attn.to_{l}": lora_change(64, 64, 4, i, alpha=2 * (i + 1)) for i, l in enumerate("qv")}
    path = write_adapter(tmp_path / "sep.safetensors", "kohya", changes)
    rules = [(r"^lora_unet_blocks_(\d+)_attn_to_q$", r"blocks.\1.attn.qkv[0:64]"),
             (r"^lora_unet_blocks_(\d+)_attn_to_v$", r"blocks.\1.attn.qkv[128:192]")]
    stats = lora_cache.merge(model, [Adapter(path, rules=rules)], cache_root=tmp_path / "cache", progress=False)
    assert stats.layers == 1
    merged = model.blocks[0].attn.qkv.weight.double()
    q = reference_merge(base[:64], [(2 / 4, changes["blocks.0.attn.to_q"])])
    v = reference_merge(base[128:], [(4 / 4, changes["blocks.0.attn.to_v"])])
    torch.testing.assert_close(merged[:64], q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(merged[128:], v, rtol=1e-6, atol=1e-6)
    assert torch.equal(model.blocks[0].attn.qkv.weight[64:128], base[64:128])  # k: zero rows add exactly nothing


def test_bf16_fused_rows_equal_the_fp32_sum_rounded_once(tmp_path):
    """Each slice of a bf16 fused weight gets what its separate weight would: the fp32 sum, one rounding."""
    model = mapped_model(tmp_path, module=FusedDiT(), dtype=torch.bfloat16)
    base = model.blocks[0].attn.qkv.weight.detach().clone()
    changes = {f"blocks.0.attn.to_{l}": lora_change(64, 64, 4, i, alpha=3) for i, l in enumerate("qkv")}
    path = write_adapter(tmp_path / "sep.safetensors", "kohya", changes)
    rules = [(rf"^lora_unet_blocks_(\d+)_attn_to_{l}$", rf"blocks.\1.attn.qkv[{64 * i}:{64 * (i + 1)}]")
             for i, l in enumerate("qkv")]
    lora_cache.merge(model, [Adapter(path, rules=rules)], cache_root=tmp_path / "cache", progress=False)
    expected = base.float().clone()
    for i, letter in enumerate("qkv"):
        change = changes[f"blocks.0.attn.to_{letter}"]
        expected[64 * i: 64 * (i + 1)].addmm_(change["up"], change["down"], alpha=3 / 4)
    assert torch.equal(model.blocks[0].attn.qkv.weight, expected.bfloat16())


def test_fused_rules_that_do_not_fit_say_why(tmp_path):
    model = mapped_model(tmp_path)
    path = write_adapter(tmp_path / "qkv.safetensors", "comfyui", {"blocks.0.attn.qkv": lora_change(160, 64, 4, 1)})
    too_few = r"has 160 rows, but the modules it is split over .* have 64 \+ 64 \+ 64 = 192"
    with pytest.raises(KeyResolutionError, match=too_few):
        plan_targets(model, [Adapter(path, rules=[_SPLIT])])
    fused = mapped_model(tmp_path / "f", module=FusedDiT())
    sep = write_adapter(tmp_path / "sep.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(64, 64, 4, 1),
                                                                 "blocks.0.attn.to_k": lora_change(64, 64, 4, 2)})
    overlapping = [(r"^lora_unet_blocks_(\d+)_attn_to_q$", r"blocks.\1.attn.qkv[0:64]"),
                   (r"^lora_unet_blocks_(\d+)_attn_to_k$", r"blocks.\1.attn.qkv[32:96]")]
    with pytest.raises(KeyResolutionError, match=r"both name module 'blocks.0.attn.qkv'"):
        plan_targets(fused, [Adapter(sep, rules=overlapping)])
    misplaced = [(r"^lora_unet_blocks_(\d+)_attn_to_q$", r"blocks.\1.attn.qkv[0:32]"),
                 (r"^lora_unet_blocks_(\d+)_attn_to_k$", r"blocks.\1.attn.qkv[64:128]")]
    short = r"has 64 rows but is placed on rows 0:32 of 'blocks.0.attn.qkv.weight'"
    with pytest.raises(KeyResolutionError, match=short):
        plan_targets(fused, [Adapter(sep, rules=misplaced)])


def test_a_rule_naming_parts_out_of_order_lands_each_block_of_rows_on_its_part(tmp_path):
    """A fused LoRA trained as (v, q, k) onto a model's qkv: the list names thirds of the
    weight in the up matrix's order, at whatever width the model has."""
    model = mapped_model(tmp_path, module=FusedDiT(dim=32))
    base, base_bias = (p.detach().clone() for p in (model.blocks[1].attn.qkv.weight, model.blocks[1].attn.qkv.bias))
    change = lora_change(96, 32, 4, 3, alpha=2)
    change["diff_b"] = torch.randn(96)
    path = write_adapter(tmp_path / "vqk.safetensors", "comfyui", {"blocks.1.attn.vqk": change})
    rule = (r"^diffusion_model\.blocks\.(\d+)\.attn\.vqk$",
            [r"blocks.\1.attn.qkv[2/3]", r"blocks.\1.attn.qkv[0/3]", r"blocks.\1.attn.qkv[1/3]"])
    stats = lora_cache.merge(model, [Adapter(path, rules=[rule])], cache_root=tmp_path / "cache", progress=False)
    assert stats.layers == 2 and stats.built == 2  # the weight and its bias
    v, q, k = change["up"].split(32)  # the up matrix's blocks, in the order it was trained
    expected = reference_merge(base, [(2 / 4, {"up": torch.cat([q, k, v]), "down": change["down"]})])
    torch.testing.assert_close(model.blocks[1].attn.qkv.weight.double(), expected, rtol=1e-6, atol=1e-6)
    bv, bq, bk = change["diff_b"].split(32)
    expected_bias = base_bias.double() + torch.cat([bq, bk, bv]).double()
    torch.testing.assert_close(model.blocks[1].attn.qkv.bias.double(), expected_bias, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("part", ["[3/3]", "[0/5]"], ids=["past the last part", "parts that do not divide the rows"])
def test_a_part_that_does_not_exist_says_what_a_part_is(tmp_path, part):
    model = mapped_model(tmp_path, module=FusedDiT(dim=32))
    path = write_adapter(tmp_path / "q.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(32, 32, 4, 1)})
    rule = (r"^lora_unet_blocks_(\d+)_attn_to_q$", rf"blocks.\1.attn.qkv{part}")
    with pytest.raises(KeyResolutionError, match=rf"is placed on part \{part[:-1]}\] of 'blocks.0.attn.qkv', whose "
                                                 r"weight has 96 rows; a part \[k/n\] is one of n equal parts"):
        plan_targets(model, [Adapter(path, rules=[rule])])


def test_the_modules_named_in_a_hint_are_real_names_not_the_root():
    from lora_cache.targets.keys import ModuleIndex

    index = ModuleIndex({"scale": (1,), "blocks.0.proj.weight": (4, 4), "blocks.1.proj.weight": (4, 4)})
    assert index.examples() == ["blocks.0.proj", "blocks.1.proj"]
