"""A LoRA on a convolution of any dimension (a video DiT's 3-D patch embedding, Wan's, a 1-D
conv) merged as peft merges it: differential against peft's ``merge_and_unload``."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import lora_cache
from tests.conftest import mapped_model

pytest.importorskip("peft", reason="the peft comparisons need peft (pip install hostmem[test])")


class Convs(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch3d = nn.Conv3d(4, 24, kernel_size=(1, 2, 2), stride=(1, 2, 2))  # Wan's patch_embedding
        self.conv1d = nn.Conv1d(8, 16, kernel_size=3)
        self.proj = nn.Linear(24, 24)


def test_lora_on_1d_and_3d_convs_merges_as_peft_merges_it(tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    wrapped = get_peft_model(Convs(), LoraConfig(r=4, lora_alpha=8, target_modules=["patch3d", "conv1d", "proj"],
                                                 init_lora_weights=False))
    path = os.path.join(tmp_path, "convs")
    wrapped.save_pretrained(path)
    reference = {k: v.clone() for k, v in wrapped.merge_and_unload().state_dict().items()}
    torch.manual_seed(0)
    model = mapped_model(Convs(), tmp_path)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache", progress=False)
    assert stats.built == 3
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(weight, reference[name], rtol=2e-6, atol=1e-6, msg=name)
    assert not torch.equal(model.patch3d.weight, base["patch3d.weight"])
    assert not torch.equal(model.conv1d.weight, base["conv1d.weight"])
