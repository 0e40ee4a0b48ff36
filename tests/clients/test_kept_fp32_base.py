"""A model loaded as users load it, some weights copies, is keyed by the folder it came from.

diffusers keeps a Wan transformer's ``time_embedder``, norms and ``scale_shift_table`` in
fp32 under ``torch_dtype=torch.bfloat16``: copies, no views of the checkpoint. A LoRA on
them (lightx2v's carry one) was refused by the cached path ("cannot tell which checkpoint
... Pass base_files=") where diffusers loads it. The folder the model records it came
from (``config._name_or_path``: the folder, a repository's root with ``subfolder=``, or the
hub's name) is taken as ``base_files``: each such weight is checked against its tensor
there, then the merge is cached, a second start all hits."""

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


def _time_lora(folder, weight) -> str:
    """A LoRA on the fp32-kept ``time_embedder.linear_1`` alone, written in ``folder``."""
    gen = torch.Generator().manual_seed(3)
    target = "condition_embedder.time_embedder.linear_1"
    path = os.path.join(folder, "time.safetensors")
    save_file({f"transformer.{target}.lora_A.weight": torch.randn(4, weight.shape[1], generator=gen) * 0.05,
               f"transformer.{target}.lora_B.weight": torch.randn(weight.shape[0], 4, generator=gen) * 0.05}, path)
    return path


def _two_experts(repo) -> None:
    """A repository laid out as Wan 2.2's: two experts of the same names and shapes, other values."""
    tm.save_model("wan", repo / "transformer", torch.bfloat16)
    second = tm.classes("wan")[0].from_pretrained(repo / "transformer")
    with torch.no_grad():
        for weight in second.parameters():
            weight.mul_(1.25)
    second.to(torch.bfloat16).save_pretrained(repo / "transformer_2")


def _each_expert_keyed_by_its_own_folder(load, tmp_path) -> None:
    keys = {}
    for sub in ("transformer", "transformer_2"):
        model = load(sub)
        path = _time_lora(tmp_path, model.condition_embedder.time_embedder.linear_1.weight)
        expected = load(sub)
        lora_cache.merge(expected, [path], enabled=False, progress=False)
        stats = lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
        assert stats.cache_key and stats.built == stats.layers == 1, stats
        for name, value in tm.weights(expected).items():
            assert torch.equal(tm.weights(model)[name], value), (sub, name)
        keys[sub] = stats.cache_key
    assert keys["transformer"] != keys["transformer_2"]


def test_a_model_from_a_subfolder_is_keyed_by_the_subfolder_that_holds_its_weights(tmp_path):
    """Loaded with ``subfolder=``, a model records the repository's root. The root's own files
    (a single-file checkpoint beside the folders) name none of the model's copies, and are
    never its key; its subfolders are searched. In a repository of two experts of the same
    names and shapes, each is keyed by the folder holding its values, never served the other's
    merge."""
    repo = tmp_path / "repo"
    _two_experts(repo)
    save_file({"unrelated.weight": torch.zeros(4)}, str(repo / "model.safetensors"))
    cls = tm.classes("wan")[0]
    _each_expert_keyed_by_its_own_folder(
        lambda sub: cls.from_pretrained(repo, subfolder=sub, torch_dtype=torch.bfloat16).eval(), tmp_path)


def test_a_model_loaded_by_its_hub_name_is_keyed_by_the_hubs_cached_files(tmp_path, monkeypatch):
    """``from_pretrained("org/name", subfolder=...)`` records the hub's name: the files are in
    the hub's local cache (laid out as the hub lays it out, read by diffusers offline), found
    there without the network. The cache also lists the whole repository, as any download of
    a part of it leaves that listing (here a README it never fetched): the snapshot still
    serves (``snapshot_download(local_files_only=True)`` refuses it as incomplete)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-wan"
    snapshot = repo / "snapshots" / ("0" * 40)
    _two_experts(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    try:
        from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache
    except ImportError:  # a hub library that keeps no listing: the layout above is the whole cache
        pass
    else:
        listed = [str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()] + ["README.md"]
        write_tree_cache(str(repo), "0" * 40, {f: TreeCacheEntry(size=1, blob_id="a" * 40) for f in listed})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    cls = tm.classes("wan")[0]

    def load(sub):
        model = cls.from_pretrained("org/tiny-wan", subfolder=sub, torch_dtype=torch.bfloat16, local_files_only=True)
        assert model.config._name_or_path == "org/tiny-wan"
        return model.eval()

    _each_expert_keyed_by_its_own_folder(load, tmp_path)


def test_a_model_loaded_at_another_revision_is_keyed_by_that_revisions_cached_files(tmp_path, monkeypatch):
    """``from_pretrained("org/name", revision=...)`` records no revision: the default one's
    snapshot names the copies but holds other values, and the snapshot that holds them is
    found among the others (a repository updated since, its older snapshot still cached)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    repo = tmp_path / "hub" / "models--org--tiny-wan"
    old, new = "1" * 40, "2" * 40
    tm.save_model("wan", repo / "snapshots" / old / "transformer", torch.bfloat16)
    _two_experts(tmp_path / "updated")
    (repo / "snapshots" / new).mkdir()
    os.rename(tmp_path / "updated" / "transformer_2", repo / "snapshots" / new / "transformer")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cls = tm.classes("wan")[0]

    def load():
        return cls.from_pretrained("org/tiny-wan", subfolder="transformer", revision=old, torch_dtype=torch.bfloat16,
                                   local_files_only=True).eval()

    model = load()
    path = _time_lora(tmp_path, model.condition_embedder.time_embedder.linear_1.weight)
    expected = load()
    lora_cache.merge(expected, [path], enabled=False, progress=False)
    stats = lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
    assert stats.cache_key and stats.built == stats.layers == 1, stats
    for name, value in tm.weights(expected).items():
        assert torch.equal(tm.weights(model)[name], value), name


def test_a_subfolder_whose_files_name_none_of_the_copies_leaves_the_start_asking_for_base_files(tmp_path):
    """Neither the root nor any subfolder ``from_pretrained`` could load (one with a
    ``config.json``) names the model's copies (it came from elsewhere): the start asks for
    base_files as before. A folder of other files (LoRAs, a loose copy of the weights) is
    never read."""
    source = tm.save_model("wan", tmp_path / "source", torch.bfloat16)
    model = tm.load_model("wan", source, torch.bfloat16)
    repo = tmp_path / "repo"
    (repo / "vae").mkdir(parents=True)
    save_file({"unrelated.weight": torch.zeros(4)}, str(repo / "vae" / "model.safetensors"))
    (repo / "vae" / "config.json").write_text("{}")
    (repo / "loose").mkdir()
    os.link(os.path.join(source, "diffusion_pytorch_model.safetensors"),
            repo / "loose" / "diffusion_pytorch_model.safetensors")  # no config.json: no subfolder= load
    model.register_to_config(_name_or_path=str(repo))
    path = _time_lora(tmp_path, model.condition_embedder.time_embedder.linear_1.weight)
    with pytest.raises(ValueError, match="cannot tell which checkpoint"):
        lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)


def test_an_expert_changed_in_memory_merges_in_place_saying_so(tmp_path):
    """Two experts name the copies and neither holds their values (the model was changed in
    memory since loading): as with one folder of other values, the start merges in place and
    says why, instead of refusing."""
    repo = tmp_path / "repo"
    _two_experts(repo)
    model = tm.classes("wan")[0].from_pretrained(repo, subfolder="transformer_2", torch_dtype=torch.bfloat16).eval()
    weight = model.condition_embedder.time_embedder.linear_1.weight
    with torch.no_grad():
        weight.add_(1.0)
    path = _time_lora(tmp_path, weight)
    with pytest.warns(UserWarning, match="differ from their tensors in base_files"):
        stats = lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
    assert stats.cache_key is None and stats.in_place == stats.layers == 1
