"""A checkpoint folder read as ``from_pretrained`` reads it: the shards its index names, the
variant asked for, and nothing that merely lies beside the weights (the same files for the
plan, ``hostmem lora merge`` and a server's start, :func:`planners.checkpoint.checkpoint_files`)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from hostmem.safetensors.header import SafetensorsError
from planners.checkpoint import checkpoint_files
from tests.conftest import write_safetensors

diffusers = pytest.importorskip("diffusers", reason="the layouts are diffusers' own (pip install hostmem[test])")

from tests.clients import tiny_models as tm  # noqa: E402


def _names(files) -> list[str]:
    return [os.path.basename(f) for f in files]


def _sharded(folder, **kwargs) -> str:
    model = tm.classes("flux")[0].from_pretrained(tm.save_model("flux", folder / "one"))
    model.save_pretrained(folder / "sharded", max_shard_size="40KB", **kwargs)
    shutil.rmtree(folder / "one")
    return os.fspath(folder / "sharded")


def test_an_index_names_the_shards_and_a_stale_whole_file_beside_them_is_left_out(tmp_path):
    folder = _sharded(tmp_path)
    index = json.load(open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    write_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"), {"x": torch.ones(2)})  # left over
    write_safetensors(os.path.join(folder, "my_lora.safetensors"), {"a.lora_A.weight": torch.ones(2, 2)})
    assert _names(checkpoint_files(folder)) == shards


def test_the_older_variant_shard_names_and_their_index_are_the_variant(tmp_path):
    """``NAME-00001-of-00002.fp16.safetensors`` listed by ``NAME.safetensors.index.fp16.json``
    (what diffusers wrote before the variant moved ahead of the shard number): loaded by
    ``from_pretrained(variant="fp16")``, so it is the fp16 variant here too."""
    folder = _sharded(tmp_path, variant="fp16")
    index_path = os.path.join(folder, "diffusion_pytorch_model.safetensors.index.fp16.json")
    index = json.load(open(index_path))
    renamed = {}
    for name in set(index["weight_map"].values()):
        older = name.replace(".fp16-", "-").replace(".safetensors", ".fp16.safetensors")
        os.rename(os.path.join(folder, name), os.path.join(folder, older))
        renamed[name] = older
    index["weight_map"] = {k: renamed[v] for k, v in index["weight_map"].items()}
    json.dump(index, open(index_path, "w"))
    tm.classes("flux")[0].from_pretrained(folder, variant="fp16")  # diffusers loads it so
    assert _names(checkpoint_files(folder, "fp16")) == sorted(renamed.values())
    os.unlink(index_path)  # without the index, by their names
    assert _names(checkpoint_files(folder, "fp16")) == sorted(renamed.values())


def test_a_lora_beside_the_weights_is_not_part_of_the_checkpoint(tmp_path):
    folder = tm.save_model("flux", tmp_path / "model")
    write_safetensors(os.path.join(folder, "pytorch_lora_weights.safetensors"), {"a.lora_A.weight": torch.ones(2, 2)})
    assert _names(checkpoint_files(folder)) == ["diffusion_pytorch_model.safetensors"]


def test_an_index_naming_a_missing_shard_is_refused_naming_it(tmp_path):
    folder = _sharded(tmp_path)
    index = json.load(open(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json")))
    gone = sorted(set(index["weight_map"].values()))[0]
    os.unlink(os.path.join(folder, gone))
    with pytest.raises(SafetensorsError, match=f"names shards that are not there: .*{gone}"):
        checkpoint_files(folder)


def test_transformers_model_file_comes_before_its_index_and_diffusers_single_file_before_unindexed_shards(tmp_path):
    """transformers loads ``model.safetensors`` where there is one, a stale index beside it or
    not; diffusers without an index loads its single file, not shards lying beside it."""
    encoder = tmp_path / "text_encoder"
    encoder.mkdir()
    write_safetensors(encoder / "model.safetensors", {"w": torch.ones(4)})
    write_safetensors(encoder / "model-00001-of-00002.safetensors", {"w": torch.zeros(4)})
    (encoder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "w": "model-00001-of-00002.safetensors"}}))
    assert _names(checkpoint_files(os.fspath(encoder))) == ["model.safetensors"]
    folder = _sharded(tmp_path)
    os.unlink(os.path.join(folder, "diffusion_pytorch_model.safetensors.index.json"))
    write_safetensors(os.path.join(folder, "diffusion_pytorch_model.safetensors"), {"x": torch.ones(2)})
    assert _names(checkpoint_files(folder)) == ["diffusion_pytorch_model.safetensors"]
