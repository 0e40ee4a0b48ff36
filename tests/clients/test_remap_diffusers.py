"""hostmem.remap on diffusers transformers loaded the way that leaves them anonymous."""

from __future__ import annotations

import os

import pytest
import torch

import hostmem
from hostmem.slots import MappedAreas

diffusers = pytest.importorskip("diffusers", reason="the remap client tests load real diffusers models")


def _flux():
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8],
    )
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 4, generator=g), encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
        img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3),
    )
    return model, inputs


def _wan():
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=256, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=8,  # rope: non-persistent buffers, kept small
    )
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
        encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
    )
    return model, inputs


MODELS = {"flux": _flux, "wan": _wan}


def _saved(tmp_path, kind, dtype=torch.float32):
    torch.manual_seed(0)
    model, inputs = MODELS[kind]()
    folder = tmp_path / kind
    model.to(dtype).save_pretrained(folder)
    return folder, inputs


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_a_disable_mmap_load_is_anonymous_and_remap_gives_it_back_bit_for_bit(tmp_path, kind):
    """After remap the model computes bit for bit what diffusers' own (mapped) load computes.

    Against the heap copy it was remapped from, the output may differ in the last bit:
    the CPU matmul kernels round by the weights' alignment (the heap's 64 bytes, a
    file offset's less), and a heap copy placed at the file's offsets matches the
    mapped weights bit for bit (measured). So the heap copy is held to 1e-6 relative.
    """
    folder, inputs = _saved(tmp_path, kind)
    cls = type(MODELS[kind]()[0])
    expected = _forward(cls.from_pretrained(folder), inputs)  # the default load: views of the file
    model = cls.from_pretrained(folder, disable_mmap=True)
    before = hostmem.account(model).totals
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert before.anonymous >= total  # every weight copied into the heap at load
    from_heap = _forward(model, inputs)
    torch.testing.assert_close(from_heap, expected, rtol=1e-6, atol=1e-6)

    report = hostmem.remap(model)  # finds diffusion_pytorch_model.safetensors from the model's config

    after = hostmem.account(model).totals
    assert after.anonymous <= 0.01 * (after.anonymous + after.file_backed + after.not_resident)
    assert report.remapped_bytes >= 0.99 * total
    assert report.files == [os.path.join(folder, "diffusion_pytorch_model.safetensors")]
    assert torch.equal(_forward(model, inputs), expected)


def test_a_cast_at_load_stays_and_is_reported_as_cast(tmp_path):
    folder, inputs = _saved(tmp_path, "flux")  # an fp32 checkpoint loaded as bf16
    model = diffusers.FluxTransformer2DModel.from_pretrained(folder, torch_dtype=torch.bfloat16)
    expected = _forward(model, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()})
    report = hostmem.remap(model)
    assert report.remapped == 0
    assert report.left_bytes["cast"] == sum(p.numel() * 2 for p in model.parameters())
    assert "cast" in str(report)
    cast_inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    assert torch.equal(_forward(model, cast_inputs), expected)


def test_after_remap_the_lora_cache_merges_without_base_files(tmp_path):
    lora_cache = pytest.importorskip("lora_cache")
    folder, _ = _saved(tmp_path, "flux")
    model = diffusers.FluxTransformer2DModel.from_pretrained(folder, disable_mmap=True)
    hostmem.remap(model)
    g = torch.Generator().manual_seed(2)
    adapter = {}
    for name, module in model.named_modules():
        if name.endswith("attn.to_q"):
            adapter[f"transformer.{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g)
            adapter[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=g)
    path = tmp_path / "lora.safetensors"
    hostmem.save_file(adapter, path)
    base = model.transformer_blocks[0].attn.to_q.weight

    stats = lora_cache.merge(model, [(str(path), 1.0)], cache_root=tmp_path / "cache")  # no base_files

    assert stats.built == 2 and stats.cache_key
    assert MappedAreas().read_only_file(model.transformer_blocks[0].attn.to_q.weight) is not None
    lora_cache.unmerge(model)
    assert model.transformer_blocks[0].attn.to_q.weight is base  # the snapshot is the mapped base, no copy


def test_a_pipeline_is_accounted_and_remapped_component_by_component(tmp_path):
    folder, _ = _saved(tmp_path, "flux")
    transformer = diffusers.FluxTransformer2DModel.from_pretrained(folder, disable_mmap=True)
    pipe = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, transformer=transformer,
    )
    ledger = hostmem.account(pipe)  # the scheduler holds no weights and is left out
    assert list(ledger.components) == ["transformer"]
    assert ledger.components["transformer"].totals.anonymous > 0
    report = hostmem.remap(pipe)
    assert report.remapped_bytes > 0 and report.left_names["missing"] == []
    assert hostmem.account(pipe).components["transformer"].totals.anonymous == 0
