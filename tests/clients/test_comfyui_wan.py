"""A ComfyUI / lightx2v Wan adapter (``diffusion_model.blocks.N.self_attn.q.lora_down.weight``,
``.alpha``, ``.diff_b``) on a diffusers Wan model: diffusers converts the keys (its ``diff_b``
becomes peft's ``lora_B.bias``), and the merge equals ``load_lora_weights`` + ``fuse_lora``."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

DIM = tm.WAN["num_attention_heads"] * tm.WAN["attention_head_dim"]
SHAPES = {"self_attn.q": (DIM, DIM), "self_attn.o": (DIM, DIM), "cross_attn.k": (DIM, DIM),
          "ffn.0": (tm.WAN["ffn_dim"], DIM), "ffn.2": (DIM, tm.WAN["ffn_dim"])}


def _lightx2v(path, rank=4, names=("lora_down", "lora_up"), alpha=lambda block: 2.0 * (block + 1)) -> str:
    """ComfyUI's Wan keys; ``alpha``: each block's stored alpha, or None for none stored."""
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for block in range(tm.WAN["num_layers"]):
        for module, (rows, cols) in SHAPES.items():
            stem = f"diffusion_model.blocks.{block}.{module}"
            tensors[f"{stem}.{names[0]}.weight"] = torch.randn(rank, cols, generator=gen) / cols**0.5
            tensors[f"{stem}.{names[1]}.weight"] = torch.randn(rows, rank, generator=gen)
            if alpha(block) is not None:
                tensors[f"{stem}.alpha"] = torch.tensor(alpha(block))
        tensors[f"diffusion_model.blocks.{block}.self_attn.q.diff_b"] = torch.randn(DIM, generator=gen)
    save_file(tensors, path)
    return os.fspath(path)


def test_lightx2v_wan_lora_equals_diffusers_load_and_fuse(tmp_path):
    model_folder = tm.save_model("wan", tmp_path / "model")
    path = _lightx2v(tmp_path / "lightx2v.safetensors")
    ours = tm.load_model("wan", model_folder)
    stats = lora_cache.load_lora(ours, path, strength=0.6, cache_root=tmp_path / "cache", progress=False)
    assert stats.built == stats.layers == 2 * (len(SHAPES) + 1)  # every weight, and the biases of q
    reference = tm.weights(tm.diffusers_fused("wan", model_folder, [(path, 0.6)]))
    base = tm.weights(tm.load_model("wan", model_folder))
    merged = tm.weights(ours)
    assert not torch.equal(merged["blocks.0.attn1.to_q.bias"], base["blocks.0.attn1.to_q.bias"])
    for name, ref in reference.items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)


def test_an_alpha_given_beside_the_file_scales_the_factors_and_never_its_diff_b(tmp_path):
    """diffusers turns a ``diff_b`` beside factors into peft's ``lora_B.bias``, which peft
    scales by alpha / rank; with the alpha stored, its converter folds it into the factors
    and the bias is added as given. ``Adapter(alpha=)`` on the file without stored alphas
    means what the file with them means: the factors at alpha / rank, the bias as given."""
    model_folder = tm.save_model("wan", tmp_path / "model")
    names = ("lora_A", "lora_B")  # peft's factor names, which diffusers' Wan converter also reads
    bare = _lightx2v(tmp_path / "bare.safetensors", names=names, alpha=lambda block: None)
    stored = _lightx2v(tmp_path / "stored.safetensors", names=names, alpha=lambda block: 16.0)
    ours = tm.load_model("wan", model_folder)
    lora_cache.load_lora(ours, lora_cache.Adapter(bare, alpha=16.0), cache_root=tmp_path / "cache", progress=False)
    reference = tm.weights(tm.diffusers_fused("wan", model_folder, [(stored, 1.0)]))
    base = tm.weights(tm.load_model("wan", model_folder))
    merged = tm.weights(ours)
    bias = "blocks.0.attn1.to_q.bias"
    assert not torch.equal(merged[bias], base[bias])
    for name, ref in reference.items():
        torch.testing.assert_close(merged[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)
