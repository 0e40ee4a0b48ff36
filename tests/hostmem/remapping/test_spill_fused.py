"""hostmem.remap(spill=True) on parameters no checkpoint tensor holds: fused, computed, views.

A fusion at load (q, k and v concatenated into one ``to_qkv``) or a parameter computed at
load has no bytes on disk: remap alone leaves it "missing" and anonymous. The spill maps
it back, the report says what each was (fused from which checkpoint tensors, told from
the bytes; computed), and weights that are views of one storage are written once and
stay views of one mapping.
"""

from __future__ import annotations

import os

import torch
from torch import nn

import hostmem
from hostmem.slots import MappedAreas
from tests.conftest import write_safetensors


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q, self.to_k, self.to_v = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16)

    def fuse(self, tamper: bool = False) -> None:
        """As diffusers' fuse_projections: a new Linear holding the three, row after row."""
        self.to_qkv = nn.Linear(32, 64)
        with torch.no_grad():
            self.to_qkv.weight.copy_(torch.cat([self.to_q.weight, self.to_k.weight, self.to_v.weight]))
            self.to_qkv.bias.copy_(torch.cat([self.to_q.bias, self.to_k.bias, self.to_v.bias]))
            if tamper:
                self.to_qkv.weight[40, 3] += 1.0

    def forward(self, x):
        return self.to_qkv(x) if hasattr(self, "to_qkv") else torch.cat([self.to_q(x), self.to_k(x), self.to_v(x)], -1)


class Fusable(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Attn(), Attn()])

    def forward(self, x):
        out = sum(block(x) for block in self.blocks)
        for name in ("computed", "u", "v"):
            if hasattr(self, name):
                out = out + getattr(self, name)
        return out


def _checkpoint_and_model(tmp_path, tamper: bool = False):
    torch.manual_seed(0)
    model = Fusable()
    path = write_safetensors(tmp_path / "model.safetensors", {k: v.clone() for k, v in model.state_dict().items()})
    model.blocks[0].fuse()
    model.blocks[1].fuse(tamper)
    model.computed = nn.Parameter(torch.linspace(0, 1, 64))  # made at load, from nothing on disk
    shared = torch.randn(2, 64)
    model.u, model.v = nn.Parameter(shared[0]), nn.Parameter(shared[1])  # two views of one storage
    return model, path


def _layer_files(root: str, key: str) -> list[str]:
    return sorted(f for f in os.listdir(os.path.join(root, "lora_merge_cache", key)) if f.endswith(".safetensors"))


def test_fused_computed_and_viewed_parameters_are_spilled_and_named(tmp_path):
    model, path = _checkpoint_and_model(tmp_path)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    before = model(x)
    assert hostmem.remap(model, files=path).left_bytes["missing"] > 0  # remap alone leaves them

    root = str(tmp_path / "cache")
    report = hostmem.remap(model, files=path, spill=True, cache_root=root)

    assert torch.equal(model(x), before)
    fused = {f"blocks.{b}.to_qkv.{leaf}": f"fused from blocks.{b}.to_q.{leaf}, blocks.{b}.to_k.{leaf}, blocks.{b}.to_v.{leaf}"
             for b in (0, 1) for leaf in ("weight", "bias")}
    assert report.spill_origins == {**fused, "computed": "computed", "u": "computed", "v": "computed"}
    assert report.left_bytes["missing"] == 0 and report.spilled == 7
    assert report.spilled_bytes == 2 * (64 * 32 + 64) * 4 + 64 * 4 + 2 * 64 * 4  # u and v's storage once
    assert "4 fused" in str(report) and "3 computed" in str(report)
    assert len(_layer_files(root, report.spill_key)) == 6  # four fused, computed, and one for u and v
    assert model.u.untyped_storage().data_ptr() == model.v.untyped_storage().data_ptr()  # still one storage
    for name, _ in model.named_parameters():
        assert MappedAreas().read_only_file(model.get_parameter(name)) is not None, name
    assert hostmem.account(model).totals.anonymous == 0

    again, _ = _checkpoint_and_model(tmp_path / "again")
    second = hostmem.remap(again, files=path, spill=True, cache_root=root)
    assert second.spill_key == report.spill_key and second.spill_written_bytes == 0
    assert torch.equal(again(x), before)


def test_rows_that_do_not_all_equal_checkpoint_tensors_are_computed_not_fused(tmp_path):
    model, path = _checkpoint_and_model(tmp_path, tamper=True)

    report = hostmem.remap(model, files=path, spill=True, cache_root=tmp_path / "cache")

    assert report.spill_origins["blocks.1.to_qkv.weight"] == "computed"  # one byte off: not the checkpoint's rows
    assert report.spill_origins["blocks.1.to_qkv.bias"].startswith("fused from blocks.1.to_q.bias")
    assert report.spill_origins["blocks.0.to_qkv.weight"].startswith("fused from blocks.0.to_q.weight")


def test_missing_buffers_are_left_for_the_model_to_write(tmp_path):
    model, path = _checkpoint_and_model(tmp_path)
    model.register_buffer("state", torch.zeros(128), persistent=False)

    report = hostmem.remap(model, files=path, spill=True, cache_root=tmp_path / "cache")

    assert report.left_names["missing"] == ["state"] and "state" not in report.spill_origins
    model.state.add_(1.0)  # still the model's own, writable memory
