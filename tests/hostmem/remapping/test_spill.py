"""hostmem.remap(spill=True): weights that differ from the checkpoint, written once and mapped back."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import hostmem
from hostmem.slots import MappedAreas
from tests.conftest import write_safetensors
from tests.hostmem.remapping.test_remap import Tiny

SPILLED = ("a.bias", "b.bias")


def _checkpoint(tmp_path) -> str:
    """The seed-0 Tiny's checkpoint, with ``a.bias`` stored in bf16 (so a load casts it)."""
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in Tiny().state_dict().items() if k != "b.weight"}
    state["a.bias"] = state["a.bias"].to(torch.bfloat16)
    return write_safetensors(tmp_path / "model.safetensors", state)


def _loaded(bump: float = 1.0) -> Tiny:
    """The seed-0 Tiny as a load leaves it: ``a.bias`` cast to fp32, ``b.bias`` changed (fused)."""
    torch.manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        model.a.bias.copy_(model.a.bias.to(torch.bfloat16).float())
        model.b.bias[3] += bump
    return model


def _spill(model, path, root, **kwargs):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    before = model(x)
    report = hostmem.remap(model, files=path, spill=True, cache_root=root, **kwargs)
    assert torch.equal(model(x), before)
    return report


def _served_from(model, name: str) -> str | None:
    return MappedAreas().read_only_file(model.get_parameter(name))


def test_cast_and_changed_weights_are_written_once_and_mapped_back(tmp_path):
    path, root = _checkpoint(tmp_path), str(tmp_path / "cache")
    model = _loaded()

    report = _spill(model, path, root)

    assert (report.remapped, report.spilled, report.spilled_bytes) == (2, 2, 2 * 64 * 4)  # a.weight, scale
    assert report.left_bytes["cast"] == report.left_bytes["changed"] == 0
    assert report.left_names["missing"] == ["cache"] and report.spill_root == root
    for name in SPILLED:
        assert _served_from(model, name).startswith(os.path.join(root, "lora_merge_cache", report.spill_key, ""))
    assert _served_from(model, "a.weight") == path
    assert hostmem.account(model).totals.anonymous <= 256 * 4 + 4096  # the non-persistent buffer's page
    assert "spilled (2 tensors: 1 cast, 1 changed;" in str(report) and report.to_dict()["spilled_bytes"] == 512
    assert report.spill_origins == {"a.bias": "cast from bfloat16", "b.bias": "changed"}

    again = _spill(_loaded(), path, root)
    assert (again.spill_written_bytes, again.spill_reused_bytes) == (0, report.spill_written_bytes)
    assert again.spill_key == report.spill_key and again.spilled == 2


def test_the_key_is_the_content_a_copied_checkpoint_hits_and_other_bytes_miss(tmp_path):
    path, root = _checkpoint(tmp_path), str(tmp_path / "cache")
    first = _spill(_loaded(), path, root)
    os.mkdir(tmp_path / "copied")
    copied = shutil.copy(path, tmp_path / "copied" / "model.safetensors")  # another path, inode and mtime

    same = _spill(_loaded(), copied, root)
    assert same.spill_key == first.spill_key and same.spill_written_bytes == 0

    model = _loaded(bump=2.0)  # b.bias changed otherwise: its cached bytes must never be served
    other = _spill(model, path, root)
    assert other.spill_key != first.spill_key and other.spill_written_bytes == first.spill_written_bytes
    assert model.b.bias[3] == _loaded(bump=2.0).b.bias[3]


def test_without_spill_nothing_is_written_and_without_room_the_weights_stay_with_a_warning(tmp_path):
    path, root = _checkpoint(tmp_path), tmp_path / "cache"
    report = hostmem.remap(_loaded(), files=path, cache_root=root)
    assert report.spilled == 0 and report.left_names["cast"] == ["a.bias"] and not root.exists()

    model = _loaded()
    with pytest.warns(UserWarning, match=r"2 weight\(s\) \(512 B\) not spilled .*no room .*max_size"):
        full = _spill(model, path, root, max_size=1)
    assert full.spilled == 0 and full.left_names["cast"] == ["a.bias"] and full.left_names["changed"] == ["b.bias"]
    assert "not all: no room" in str(full) and _served_from(model, "a.bias") is None
    left = os.listdir(os.path.join(root, "lora_merge_cache"))
    assert left == ["content_hashes.json"], left  # the checkpoint's digest memo; nothing half-built


def test_the_planner_is_offered_the_spill_with_its_disk(tmp_path):
    from hostmem.remapping.offer import RemapProvider
    from hostmem.vault import layer_file_bytes
    from planners.providers import remap_providers

    path = _checkpoint(tmp_path)
    model = _loaded()
    plain = RemapProvider.from_model("dit", model, path).offer()
    assert plain.disk_bytes == 0 and "hostmem.remap(spill=True) would map them back" in plain.note

    offer = RemapProvider.from_model("dit", model, path, spill=True).offer()
    assert offer.disk_bytes == layer_file_bytes((64,), torch.float32)  # a.bias, the cast one
    (through_planner,) = remap_providers({"dit": model}, path, spill=True)
    assert through_planner.offer() == offer
    assert 64 * 4 <= offer.anonymous_bytes - plain.anonymous_bytes <= 4096
    assert offer.one_time_s > plain.one_time_s and "spill=True" in offer.note

    _spill(model, path, tmp_path / "cache")
    assert RemapProvider.from_model("dit", model, path, spill=True).offer() is None
