"""DoRA through diffusers' converter: ``load_lora`` of a DoRA file diffusers wrote merges as
peft's merge_and_unload does (the magnitude vectors reach the merge, not dropped)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402


def _trained_magnitudes(path: str) -> None:
    """Move the magnitudes off the norms peft starts them at (as training does), in place."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, "pt") as handle:
        metadata = handle.metadata()
    tensors = {k: v.clone() for k, v in load_file(path).items()}  # not views of the file rewritten below
    gen = torch.Generator().manual_seed(7)
    for key in [k for k in tensors if k.endswith("lora_magnitude_vector")]:
        tensors[key] = tensors[key] * (0.5 + torch.rand(tensors[key].shape, generator=gen))
    save_file(tensors, path, metadata=metadata)


@pytest.mark.parametrize("layout", ["peft", "diffusers_meta"])
def test_load_lora_of_a_dora_file_equals_peft_merge(tmp_path, layout):
    model_folder = tm.save_model("flux", tmp_path / "model")
    paths = tm.write_adapters("flux", model_folder, tmp_path / "adapters", use_dora=True)
    files = {"peft": os.path.join(paths["peft"], "adapter_model.safetensors"),
             "diffusers_meta": os.path.join(paths["diffusers_meta"], "pytorch_lora_weights.safetensors")}
    for path in files.values():
        _trained_magnitudes(path)  # the same seed: both files carry the same magnitudes
    reference = tm.weights(tm.peft_merged("flux", model_folder, paths["peft"]))
    model = tm.load_model("flux", model_folder)
    adapter = paths["peft"] if layout == "peft" else files[layout]
    stats = lora_cache.load_lora(tm.pipeline("flux", model), adapter, cache_root=tmp_path / "cache", progress=False)
    assert stats.built == stats.layers > 0
    merged = tm.weights(model)
    for name, weight in reference.items():
        torch.testing.assert_close(merged[name], weight, rtol=1e-5, atol=1e-6, msg=name)
