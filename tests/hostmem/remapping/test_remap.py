"""hostmem.remap: weights equal to their checkpoint become read-only views of it again."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import hostmem
from hostmem.remapping.files import CheckpointNotFound, checkpoint_files
from hostmem.slots import MappedAreas
from tests.conftest import write_safetensors


class Tiny(nn.Module):
    """Two linears with a tied weight, a persistent and a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)
        self.b.weight = self.a.weight  # tied: one Parameter, two modules
        self.register_buffer("scale", torch.full((64,), 0.5))
        self.register_buffer("cache", torch.zeros(256), persistent=False)

    def forward(self, x):
        return self.b(self.a(x) * self.scale)


def _model_and_checkpoint(tmp_path, name="model.safetensors"):
    torch.manual_seed(0)
    model = Tiny()
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "b.weight"}
    path = write_safetensors(tmp_path / name, state)
    return model, path


def _anonymous(model) -> int:
    return hostmem.account(model).totals.anonymous


def test_remap_points_equal_weights_at_the_checkpoint_and_frees_the_copies(tmp_path):
    model, path = _model_and_checkpoint(tmp_path)
    x = torch.randn(4, 64)
    before = model(x)
    assert _anonymous(model) > 0

    report = hostmem.remap(model, files=path)

    areas = MappedAreas()
    mapped = {n for n, t in model.named_parameters(remove_duplicate=False) if areas.read_only_file(t) == path}
    assert mapped == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert model.a.weight is model.b.weight  # the tie survives: one tensor, both places
    state = areas.area_of(model.scale)  # a buffer: the file mapped private and writable, as safetensors maps it
    assert areas.read_only_file(model.scale) is None and state.path == path and "w" in state.perms
    assert report.remapped == 4 and report.left_bytes["missing"] == 256 * 4  # the non-persistent buffer
    assert report.left_names["missing"] == ["cache"]
    assert _anonymous(model) <= 256 * 4 + 4096  # what remains anonymous: the buffer (its page)
    assert torch.equal(model(x), before)


def test_weights_that_differ_stay_and_are_reported_by_reason(tmp_path):
    model, _ = _model_and_checkpoint(tmp_path)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "b.weight"}
    state["a.bias"] = state["a.bias"].to(torch.bfloat16)  # the checkpoint holds it in another dtype
    state["b.bias"][3] += 1  # changed after load (a fused or merged weight)
    path = write_safetensors(tmp_path / "other.safetensors", state)
    with torch.no_grad():
        model.scale.zero_().neg_()  # -0.0 everywhere: equal in value to a checkpoint of +0.0, not in bytes
    write_safetensors(tmp_path / "zeros.safetensors", {"scale": torch.zeros(64)})

    report = hostmem.remap(model, files=[path])
    assert report.left_names["cast"] == ["a.bias"] and report.left_bytes["cast"] == 64 * 4
    assert "b.bias" in report.left_names["changed"]
    assert MappedAreas().read_only_file(model.a.bias) is None

    zeros = hostmem.remap(model, files=tmp_path / "zeros.safetensors")
    assert zeros.left_names["changed"] == ["scale"]
    assert "cast" in str(report) and "changed" in str(report)


def test_remap_twice_finds_everything_already_mapped(tmp_path):
    model, path = _model_and_checkpoint(tmp_path)
    first = hostmem.remap(model, files=path)
    again = hostmem.remap(model, files=path)
    assert again.remapped == 0
    assert again.already_mapped_bytes == first.remapped_bytes


def test_names_match_up_to_wrapper_prefixes(tmp_path):
    model, path = _model_and_checkpoint(tmp_path)
    wrapped = nn.Module()
    wrapped.model = model  # the model's names now carry a prefix the file lacks
    report = hostmem.remap({"dit": wrapped}, files=path)
    assert report.remapped == 4
    assert report.left_names["missing"] == ["dit.model.cache"]


def test_the_checkpoint_is_found_from_the_model_config_and_index(tmp_path):
    folder = tmp_path / "transformer"
    folder.mkdir()
    model, _ = _model_and_checkpoint(folder, "diffusion_pytorch_model-00001-of-00001.safetensors")
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a.weight": "diffusion_pytorch_model-00001-of-00001.safetensors"}}))
    model.config = {"_name_or_path": str(folder)}
    assert checkpoint_files(model) == [str(folder / "diffusion_pytorch_model-00001-of-00001.safetensors")]
    assert hostmem.remap(model).remapped == 4

    pipeline_root = {"_name_or_path": str(tmp_path)}  # a model loaded with subfolder= records the root
    model.config = pipeline_root
    assert hostmem.remap(model).already_mapped_bytes > 0


def test_a_model_that_records_no_checkpoint_gets_an_error_saying_what_to_pass(tmp_path):
    with pytest.raises(CheckpointNotFound, match="pass files="):
        hostmem.remap(Tiny())
    model = Tiny()
    model.config = {"_name_or_path": str(tmp_path / "nowhere")}
    with pytest.raises(CheckpointNotFound, match="neither a folder nor in the local hub cache"):
        hostmem.remap(model)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointNotFound, match="no .safetensors checkpoint"):
        hostmem.remap(model, files=tmp_path / "empty")


def test_a_pipeline_component_without_a_checkpoint_is_skipped_and_named_the_others_remapped(tmp_path):
    model, path = _model_and_checkpoint(tmp_path)
    model.config = {"_name_or_path": str(tmp_path)}
    head = nn.Linear(8, 8)  # built in memory: no checkpoint anywhere
    report = hostmem.remap({"dit": model, "head": head})
    assert report.remapped == 4 and list(report.skipped) == ["head"] and "pass files=" in report.skipped["head"]
    assert "component 'head' skipped" in str(report) and report.to_dict()["skipped"] == report.skipped
    (tmp_path / "other").mkdir()
    other, other_path = _model_and_checkpoint(tmp_path / "other")
    again = hostmem.remap({"dit": other, "head": head}, files={"dit": other_path})  # files by component
    assert again.remapped == 4 and list(again.skipped) == ["head"]
    with pytest.raises(CheckpointNotFound, match="no component of: its components are 'dit'"):
        hostmem.remap({"dit": other}, files={"vae": other_path})


def test_the_planner_is_offered_the_remap_until_it_is_done(tmp_path):
    from hostmem.remapping.offer import RemapProvider
    from planners.providers import Offer, OfferRecord, Provider, collect_offers, remap_providers

    model, path = _model_and_checkpoint(tmp_path)
    model.config = {"_name_or_path": str(tmp_path)}
    weights = (64 * 64 + 64 + 64 + 64) * 4  # the tied weight once, two biases, the persistent buffer
    (provider,) = remap_providers({"dit": model, "unsaved": Tiny()})  # no checkpoint recorded: skipped
    assert isinstance(provider, Provider) and isinstance(provider.offer(), Offer)
    (record,) = collect_offers([provider], {"dit"})
    assert record == OfferRecord.of(provider.offer())
    assert record.provider == "remap" and record.disk_bytes == 0
    assert weights <= record.anonymous_bytes <= weights + 3 * 4096  # page-split bytes: near the weights
    assert "hostmem.remap" in record.note

    hostmem.remap(model)
    assert RemapProvider.from_model("dit", model).offer() is None


def test_buffers_a_model_writes_are_remapped_copy_on_write_and_a_training_pass_writes_them(tmp_path):
    """BatchNorm updates its running statistics in place in training: a read-only view
    would kill the process (SIGSEGV). The remapped buffers take the write as safetensors'
    own mapping does: the pages written turn anonymous, the rest stay the file's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    path = write_safetensors(tmp_path / "bn.safetensors", {k: v.clone() for k, v in model.state_dict().items()})
    twin = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16))
    twin.load_state_dict(model.state_dict())
    report = hostmem.remap(model, files=path)
    assert report.remapped == 7 and report.total_left_bytes == 0, report
    assert MappedAreas().read_only_file(model[0].weight) == path  # weights stay read-only
    x = torch.randn(8, 16)
    model.train(), twin.train()
    assert torch.equal(model(x), twin(x))
    assert torch.equal(model[1].running_mean, twin[1].running_mean) and int(model[1].num_batches_tracked) == 1
    assert torch.equal(model.eval()(x), twin.eval()(x))


def test_weights_mapped_from_a_copy_on_tmpfs_are_not_already_mapped_and_move_to_the_checkpoint(tmp_path):
    """A tmpfs file's pages are shmem, never given back: a model mapped from such a copy
    (a checkpoint staged in /dev/shm) is pointed at the checkpoint on disk."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm on this machine")
    model, path = _model_and_checkpoint(tmp_path)
    staged = os.path.join("/dev/shm", f"hostmem-test-{os.getpid()}.safetensors")
    with open(path, "rb") as src, open(staged, "wb") as dst:
        dst.write(src.read())
    try:
        model.load_state_dict(hostmem.load_readonly(staged), strict=False, assign=True)
        model.b.weight = model.a.weight
        assert MappedAreas().read_only_file(model.a.weight) == staged
        report = hostmem.remap(model, files=path)
        assert report.already_mapped_bytes == 0 and report.remapped == 4, report
        assert MappedAreas().read_only_file(model.a.weight) == path
        assert hostmem.account(model).totals.shmem == 0
    finally:
        os.unlink(staged)
