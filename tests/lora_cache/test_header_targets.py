"""Adapter targets from headers alone against the merge's own reader (differential).

The header reading (lora_cache.targets.header_targets) and the merge's reader and planner
(lora_cache.adapters + lora_cache.targets.keys) must name the same checkpoint weights for
every layout the fast path takes, and hand everything else to the reader.
"""

from __future__ import annotations

import os

import pytest
import torch

from lora_cache.targets.header_targets import NeedsReader, header_targets
from lora_cache.provider import _read_targets, target_layers
from hostmem.safetensors.header import read_header
from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

MODULES = [f"blocks.{i}.attn.{w}" for i in range(3) for w in ("to_q", "to_k")]


def _checkpoint(tmp_path, conv: bool = False):
    tensors = {f"{m}.weight": torch.zeros(32, 16, dtype=torch.bfloat16) for m in MODULES}
    tensors.update({f"{m}.bias": torch.zeros(32, dtype=torch.bfloat16) for m in MODULES})
    tensors["blocks.0.proj_in.weight"] = torch.zeros(32, 16, 3, 3)
    tensors["blocks.0.attn.qkv.weight"] = torch.zeros(96, 16)
    shards = [write_safetensors(tmp_path / "dit-1.safetensors", dict(list(tensors.items())[:7])),
              write_safetensors(tmp_path / "dit-2.safetensors", dict(list(tensors.items())[7:]))]
    return shards


def _shapes(shards):
    return {n: i.shape for s in shards for n, i in read_header(s).tensors.items()}


def _reader_names(shards, adapters):
    infos = {n: i for s in shards for n, i in read_header(s).tensors.items()}
    return _read_targets(infos, dict.fromkeys(infos, shards[0]), adapters, None)[0]


def _layouts(tmp_path):
    """One adapter file per layout the fast path takes, each with its own targets."""
    pair = {m: lora_change(32, 16, 4, i, alpha=2) for i, m in enumerate(MODULES[:4])}
    diffs = {MODULES[4]: {"diff": torch.ones(32, 16), "diff_b": torch.ones(32)},
             MODULES[5]: {**lora_change(32, 16, 2, 9), "diff_b": torch.ones(32)}}
    conv = {"blocks.0.proj_in": lora_change(32, 16, 4, 3, conv=(3, 3))}
    peft_keys = {f"transformer.{m}.lora_{p}.weight": t for m, c in pair.items()
                 for p, t in (("A", c["down"]), ("B", c["up"]))}
    peft_keys[f"transformer.{MODULES[1]}.lora_B.bias"] = torch.ones(32)
    return {
        "kohya": write_adapter(tmp_path / "kohya.safetensors", "kohya", pair),
        "comfyui": write_adapter(tmp_path / "comfy.safetensors", "comfyui", {**pair, **diffs}),
        "lightx2v": write_adapter(tmp_path / "lightx2v.safetensors", "comfyui", diffs, prefix="diffusion_model."),
        "peft keys": write_safetensors(tmp_path / "peft-keys.safetensors", {
            f"base_model.model.{m}.lora_{p}.weight": t for m, c in pair.items()
            for p, t in (("A", c["down"]), ("B", c["up"]))}),
        "diffusers": write_safetensors(tmp_path / "diffusers.safetensors", peft_keys),
        "conv": write_adapter(tmp_path / "conv.safetensors", "kohya", conv),
        "dora keys": write_safetensors(tmp_path / "dora.safetensors", {
            f"base_model.model.{MODULES[0]}.lora_A.weight": pair[MODULES[0]]["down"],
            f"base_model.model.{MODULES[0]}.lora_B.weight": pair[MODULES[0]]["up"],
            f"base_model.model.{MODULES[0]}.lora_magnitude_vector": torch.ones(32)}),
        "peft folder": write_adapter(tmp_path / "peft", "peft",  # save_pretrained's file and config
                                     {m: lora_change(32, 16, 4, i) for i, m in enumerate(MODULES[2:])}),
    }


def test_every_common_layout_names_what_the_reader_names(tmp_path):
    shards = _checkpoint(tmp_path)
    layouts = _layouts(tmp_path)
    for name, path in layouts.items():
        fast = header_targets([path], _shapes(shards))
        assert fast, name
        assert fast == _reader_names(shards, [path]), name
    every = [(p, 0.5) for p in layouts.values()]
    assert header_targets(every, _shapes(shards)) == _reader_names(shards, every)
    renamed = [{"path": layouts["kohya"], "rules": [{"match": "^.*_1_attn_to_k$", "replace": "blocks.0.attn.to_k"}]}]
    with pytest.raises(NeedsReader, match="both name"):  # two keys now name one module
        header_targets(renamed, _shapes(shards))
    with pytest.raises(ValueError, match="both name module"):  # and the reader refuses it, as it did
        target_layers(shards, renamed)


def test_a_rule_to_a_whole_module_is_taken_and_agrees(tmp_path):
    shards = _checkpoint(tmp_path)
    path = write_adapter(tmp_path / "a.safetensors", "kohya", {"blocks.0.attn.to_q": lora_change(32, 16, 4, 0)},
                         prefix="lora_unet_double_")
    spec = [{"path": path, "rules": [{"match": "^lora_unet_double_blocks_0_attn_to_q$",
                                     "replace": "blocks.1.attn.to_k"}]}]
    assert header_targets(spec, _shapes(shards)) == ("blocks.1.attn.to_k.weight",) == _reader_names(shards, spec)


def _two_files(folder) -> str:
    for name in ("a", "b"):
        write_adapter(folder / f"{name}.safetensors", "kohya", {MODULES[0]: lora_change(32, 16, 4, 0)})
    return str(folder)


def test_what_only_the_reader_can_tell_goes_to_the_reader(tmp_path):
    shards = _checkpoint(tmp_path)
    shapes = _shapes(shards)
    cases = {
        "a folder naming no file": _two_files(tmp_path / "two"),
        "peft's DoRA": write_adapter(tmp_path / "dora", "peft", {MODULES[0]: lora_change(32, 16, 4, 0)},
                                     config={"use_dora": True}),
        "an unknown part": write_safetensors(tmp_path / "ia3.safetensors", {
            "lora_unet_blocks_0_attn_to_q.on_input": torch.ones(4, 16)}),
        "a LoHa": write_safetensors(tmp_path / "loha.safetensors", {
            "lora_unet_blocks_0_attn_to_q.hada_w1_a": torch.ones(4, 16)}),
        "a key naming no module": write_adapter(tmp_path / "miss.safetensors", "kohya",
                                                {"blocks.7.attn.to_q": lora_change(32, 16, 4, 0)}),
        "a pair of another size": write_adapter(tmp_path / "size.safetensors", "kohya",
                                                {MODULES[0]: lora_change(64, 16, 4, 0)}),
        "a lone down": write_safetensors(tmp_path / "lone.safetensors", {
            "lora_unet_blocks_0_attn_to_q.lora_down.weight": torch.ones(4, 16)}),
        "rows of a fused weight": {"path": write_adapter(tmp_path / "q.safetensors", "kohya",
                                                         {MODULES[0]: lora_change(32, 16, 4, 0)}),
                                   "rules": [{"match": "^.*to_q$", "replace": "blocks.0.attn.qkv[0:32]"}]},
    }
    reasons = {"a folder naming no file": "a folder without", "peft's DoRA": "DoRA", "an unknown part": "no part", "a LoHa": "LoHa, LoKr or Tucker LoCon", "a key naming no module": "names no module",
               "a pair of another size": "does not fit", "a lone down": "lacks a matrix",
               "rows of a fused weight": "rows of a fused weight"}
    for what, spec in cases.items():
        with pytest.raises(NeedsReader, match=reasons[what]):
            header_targets([spec], shapes)
            pytest.fail(what)
    found = target_layers(shards, [cases["rows of a fused weight"]])  # the reader takes it, and says so
    assert found.names == ("blocks.0.attn.qkv.weight",) and "rows of a fused weight" in found.read_with_torch
    with pytest.raises(ValueError, match="match no module"):  # the reader's own refusal, as before
        target_layers(shards, [cases["a key naming no module"]])


def test_target_layers_reads_headers_alone_for_a_common_layout(tmp_path):
    shards = _checkpoint(tmp_path)
    path = _layouts(tmp_path)["comfyui"]
    found = target_layers(shards, [path])
    assert found.read_with_torch is None
    infos = {n: i for s in shards for n, i in read_header(s).tensors.items()}
    assert found.names == _reader_names(shards, [path])
    assert found.nbytes == sum(infos[n].nbytes for n in found.names)
    assert found.largest_nbytes == 32 * 16 * 2 and found.largest_numel == 32 * 16


def test_a_peft_folder_names_the_weights_peft_itself_changes(tmp_path):
    """Differential against peft: save_pretrained's folder, read from its header, names
    exactly the weights peft's merge_and_unload changes."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    torch.manual_seed(0)
    base = nn.ModuleDict({f"block{i}": nn.ModuleDict({"q": nn.Linear(16, 32), "k": nn.Linear(16, 32),
                                                       "out": nn.Linear(32, 16)}) for i in range(3)})
    before = {k: v.detach().clone() for k, v in base.state_dict().items()}
    shard = write_safetensors(tmp_path / "base.safetensors", before)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "out"], init_lora_weights=False)
    wrapped = get_peft_model(base, lora)
    wrapped.save_pretrained(tmp_path / "peft")
    merged = wrapped.merge_and_unload().state_dict()
    changed = tuple(name for name in _shapes([shard]) if not torch.equal(before[name], merged[name]))
    assert changed and all(".q." in n or ".out." in n for n in changed)
    assert header_targets([str(tmp_path / "peft")], _shapes([shard])) == changed
    assert _reader_names([shard], [str(tmp_path / "peft")]) == changed


def test_every_file_of_the_conformance_corpus_is_read_alike_or_handed_to_the_reader(tmp_path):
    """Differential over the corpus (real writers: peft's save_pretrained, diffusers'
    save_lora_weights): where the header reading names weights, the reader names the same;
    what it hands back, the reader takes or refuses itself."""
    import glob

    pytest.importorskip("diffusers", reason="the corpus's tiny models are diffusers models")
    from tests.conformance import models
    from tests.conformance.corpus import CASES

    folders, read_alike = {}, []
    for case in CASES:
        if case.kind not in folders:
            folders[case.kind] = models.save_model(case.kind, tmp_path / "models" / case.kind)
        shards = sorted(glob.glob(os.path.join(folders[case.kind], "*.safetensors")))
        os.makedirs(tmp_path / case.name)
        spec = {"path": case.write(str(tmp_path / case.name), folders[case.kind])}
        try:
            fast = header_targets([spec], _shapes(shards))
        except NeedsReader:
            continue
        assert fast == _reader_names(shards, [spec]), case.name
        read_alike.append(case.name)
    # peft's save_pretrained folders and diffusers' save_lora_weights files never need the reader
    assert {"wan-peft-anchored-patterns", "wan-peft-rslora", "wan-diffusers-metadata"} <= set(read_alike)
