"""A model loaded as users load it, some weights copies, is keyed by the folder it came from.

diffusers keeps a Wan transformer's ``time_embedder``, norms and ``scale_shift_table`` in
fp32 under ``torch_dtype=torch.bfloat16``: copies, no views of the checkpoint. A LoRA on
them (lightx2v's carry one) was refused by the cached path ("cannot tell which checkpoint
... Pass base_files=") where diffusers loads it. The folder the model records it came
from (``config._name_or_path``) is taken as ``base_files``: each such weight is checked
against its tensor there, then the merge is cached, a second start all hits."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the model needs diffusers (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402


def test_a_lora_on_wans_fp32_kept_time_embedder_is_cached_keyed_by_the_load_folder(tmp_path):
    folder = tm.save_model("wan", tmp_path / "wan", torch.bfloat16)
    model = tm.load_model("wan", folder, torch.bfloat16)
    weight = model.condition_embedder.time_embedder.linear_1.weight
    assert weight.dtype == torch.float32  # kept: a copy, no view of the file
    gen = torch.Generator().manual_seed(3)
    target = "condition_embedder.time_embedder.linear_1"
    path = str(tmp_path / "time.safetensors")
    save_file({f"transformer.{target}.lora_A.weight": torch.randn(4, weight.shape[1], generator=gen) * 0.05,
               f"transformer.{target}.lora_B.weight": torch.randn(weight.shape[0], 4, generator=gen) * 0.05,
               "transformer.blocks.0.attn1.to_q.lora_A.weight": torch.randn(4, weight.shape[0], generator=gen) * 0.05,
               "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.randn(weight.shape[0], 4, generator=gen) * 0.05},
              path)
    expected = tm.load_model("wan", folder, torch.bfloat16)
    lora_cache.merge(expected, [path], enabled=False, progress=False)
    stats = lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
    assert stats.built == stats.layers == 2 and stats.cache_key
    again = lora_cache.load_lora(tm.load_model("wan", folder, torch.bfloat16), path, cache_root=tmp_path / "cache",
                                 progress=False)
    assert (again.hit, again.built, again.cache_key) == (2, 0, stats.cache_key)
    for name, value in tm.weights(expected).items():
        assert torch.equal(tm.weights(model)[name], value), name
    other = tm.save_model("wan", tmp_path / "other", torch.bfloat16)  # another folder's weights: never its key
    moved = tm.load_model("wan", other, torch.bfloat16)
    with torch.no_grad():
        moved.condition_embedder.time_embedder.linear_1.weight.add_(1.0)  # no longer the file's
    with pytest.warns(UserWarning, match="differ from their tensors in base_files"):
        lora_cache.load_lora(moved, path, cache_root=tmp_path / "cache", progress=False)


def test_a_model_from_a_subfolder_is_never_keyed_by_the_repositorys_other_files(tmp_path):
    """Loaded with ``subfolder=``, a model records the repository's root: its weights files
    there (a single-file checkpoint beside the folders) name none of the model's copies,
    and would say nothing of their bytes. The start asks for base_files as before."""
    repo = tmp_path / "repo"
    tm.save_model("wan", repo / "transformer", torch.bfloat16)
    save_file({"unrelated.weight": torch.zeros(4)}, str(repo / "model.safetensors"))
    model = tm.classes("wan")[0].from_pretrained(repo, subfolder="transformer", torch_dtype=torch.bfloat16)
    weight = model.condition_embedder.time_embedder.linear_1.weight
    target = "condition_embedder.time_embedder.linear_1"
    path = str(tmp_path / "time.safetensors")
    save_file({f"transformer.{target}.lora_A.weight": torch.randn(4, weight.shape[1]) * 0.05,
               f"transformer.{target}.lora_B.weight": torch.randn(weight.shape[0], 4) * 0.05}, path)
    with pytest.raises(ValueError, match="cannot tell which checkpoint"):
        lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
