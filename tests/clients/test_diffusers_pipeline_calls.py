"""The diffusers calls a server makes around lora_cache, held to diffusers' own result:
``load_lora_weights``' keywords (``load_into_transformer_2`` on a Wan 2.2 pipeline), the
weights ``set_adapters`` reads, and diffusers' LoRA layers beside lora_cache's merges."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.errors import InputError  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A tiny Wan transformer saved with save_pretrained, and two diffusers-format LoRAs for it."""
    root = tmp_path_factory.mktemp("wan")
    model = tm.save_model("wan", root / "model")
    return model, [tm.write_adapters("wan", model, root / f"lora{seed}", seed=seed)["diffusers_meta"]
                   for seed in (1, 2)]


def _wan22(folder):
    """A Wan 2.2 pipeline: two experts (the same tiny checkpoint, loaded twice)."""
    return tm.pipeline("wan", tm.load_model("wan", folder), transformer_2=tm.load_model("wan", folder),
                       boundary_ratio=0.9)


def _assert_close(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for name, ref in reference.items():
        torch.testing.assert_close(ours[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)


def _changed(model, base: dict) -> list[str]:
    return [n for n, w in tm.weights(model).items() if not torch.equal(w, base[n])]


def test_load_into_transformer_2_merges_into_the_second_expert_as_diffusers_does(wan, tmp_path):
    folder, (adapter, _) = wan
    base = tm.weights(tm.load_model("wan", folder))
    reference = _wan22(folder)
    reference.load_lora_weights(adapter, adapter_name="a", weight_name=tm._weight_name(adapter),
                                load_into_transformer_2=True)
    reference.fuse_lora(components=["transformer_2"])
    pipe = _wan22(folder)
    stats = lora_cache.load_lora(pipe, adapter, cache_root=tmp_path, progress=False, load_into_transformer_2=True)
    assert stats.built == stats.layers > 0
    assert not _changed(pipe.transformer, base) and not _changed(reference.transformer, base)
    assert _changed(pipe.transformer_2, base)
    _assert_close(tm.weights(pipe.transformer_2), tm.weights(reference.transformer_2))
    lora_cache.unmerge(pipe.transformer_2)
    assert not _changed(pipe.transformer_2, base)


def test_a_keyword_load_lora_does_not_take_is_named(wan, tmp_path):
    folder, (adapter, _) = wan
    pipe = _wan22(folder)
    with pytest.raises(InputError, match=r"keyword adapter_name=; name adapters .*set_pipeline_adapters"):
        lora_cache.load_lora(pipe, adapter, cache_root=tmp_path, adapter_name="a")
    with pytest.raises(InputError, match=r"keyword low_cpu_mem_usage=; leave it out\. .*weight_name=, "
                                         r"load_into_transformer_2= .*base_files"):
        lora_cache.load_lora(pipe, adapter, cache_root=tmp_path, low_cpu_mem_usage=True)
    wan21 = tm.pipeline("wan", tm.load_model("wan", folder))
    with pytest.raises(InputError, match=r"WanPipeline has no transformer_2 .* leave load_into_transformer_2 out"):
        lora_cache.load_lora(wan21, adapter, cache_root=tmp_path, load_into_transformer_2=True)
    with pytest.raises(InputError, match="takes a pipeline with a transformer_2"):
        lora_cache.load_lora(pipe.transformer, adapter, cache_root=tmp_path, load_into_transformer_2=True)
    base = tm.weights(tm.load_model("wan", folder))
    assert not _changed(pipe.transformer, base) and not _changed(pipe.transformer_2, base)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # peft, on diffusers' second adapter
@pytest.mark.parametrize("weights", [[None, np.float32(0.5)], [torch.tensor(-0.75), np.int64(2)], np.float32(0.5)],
                         ids=["none-numpy", "tensor-numpy-int", "one-numpy"])
def test_set_pipeline_adapters_reads_weights_as_diffusers_set_adapters_does(wan, weights, tmp_path):
    from lora_cache.switching.diffusers_switch import set_pipeline_adapters

    folder, adapters = wan
    files = {"a": adapters[0], "b": adapters[1]}
    pipe = tm.pipeline("wan", tm.load_model("wan", folder))
    result = set_pipeline_adapters(pipe, ["a", "b"], weights, files=files, cache_root=tmp_path, background=False)
    assert result.mode != "base"
    per_name = weights if isinstance(weights, list) else [weights] * 2
    reference = tm.diffusers_fused("wan", folder, list(zip(adapters, per_name)))  # set_adapters takes them as given
    _assert_close(tm.weights(pipe.transformer), tm.weights(reference))


def test_set_pipeline_adapters_names_what_is_wrong_with_a_weight(wan, tmp_path):
    from lora_cache.switching.diffusers_switch import set_pipeline_adapters

    folder, adapters = wan
    files = {"a": adapters[0], "b": adapters[1]}
    pipe = tm.pipeline("wan", tm.load_model("wan", folder))

    def switch(weights):
        return set_pipeline_adapters(pipe, ["a", "b"], weights, files=files, cache_root=tmp_path)

    with pytest.raises(InputError, match=r"weight of 'b' is a dict; .*dicts\) are not supported"):
        switch([1.0, {"transformer": 0.5}])
    with pytest.raises(InputError, match=r"\(dicts\) are not supported"):
        switch({"transformer": 0.5})
    for bad in ("0.5", torch.tensor([0.5]), 1j):
        with pytest.raises(InputError, match=r"the weight of 'b', .* is not a real number") as refused:
            switch([1.0, bad])
        assert "dict" not in str(refused.value)
    for bad in (float("nan"), np.float32("inf")):
        with pytest.raises(ValueError, match=r"(?i)nan|inf|finite"):
            switch([1.0, bad])
    base = tm.weights(tm.load_model("wan", folder))
    assert not _changed(pipe.transformer, base)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
def test_a_pipeline_holding_diffusers_lora_layers_is_refused_naming_them(wan, tmp_path):
    """diffusers' layers (loaded, then fused) are named with what to do, not as keys matching no
    module; once diffusers takes them off, lora_cache merges as diffusers' own fuse does."""
    from lora_cache.switching.diffusers_switch import set_pipeline_adapters

    folder, (first, second) = wan
    pipe = tm.pipeline("wan", tm.load_model("wan", folder))
    pipe.load_lora_weights(first, adapter_name="c", weight_name=tm._weight_name(first))
    with pytest.raises(InputError, match=r"holds diffusers/peft LoRA layers.*transformer: \d+ layer\(s\) "
                                         r"\(transformer\.blocks\.0\..*\), adapter\(s\) 'c'\).*pipe\.unload_lora_weights\(\)"):
        lora_cache.load_lora(pipe, second, cache_root=tmp_path, progress=False)
    pipe.fuse_lora()
    with pytest.raises(InputError, match=r"adapter\(s\) 'c' \(fused\)\).*pipe\.unfuse_lora\(\); "
                                         r"pipe\.unload_lora_weights\(\).*through lora_cache") as refused:
        set_pipeline_adapters(pipe, ["a"], files={"a": second}, cache_root=tmp_path)
    assert "match no module" not in str(refused.value)
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    with pytest.warns(UserWarning, match="changed in memory"):  # fused and unfused: no longer its file
        stats = lora_cache.load_lora(pipe, second, cache_root=tmp_path, progress=False)
    assert stats.in_place == stats.layers > 0
    _assert_close(tm.weights(pipe.transformer), tm.weights(tm.diffusers_fused("wan", folder, second)))


@pytest.mark.parametrize("how", ["cached", "in place", "run time"])
def test_diffusers_lora_off_calls_refuse_where_lora_cache_holds_the_lora(wan, how, tmp_path):
    """unfuse_lora, unload_lora_weights and disable_lora act on diffusers' own layers only: on a
    LoRA lora_cache applied they would return with it still on, so they say so and change nothing."""
    from hostmem.safetensors.writers import LoraHeldElsewhereError
    from lora_cache.switching.diffusers_switch import set_pipeline_adapters

    folder, (adapter, _) = wan
    pipe = tm.pipeline("wan", tm.load_model("wan", folder))
    if how == "run time":  # a combination not cached yet: served at run time until the next forward
        assert set_pipeline_adapters(pipe, ["a"], files={"a": adapter}, cache_root=tmp_path).mode == "runtime"
    else:
        lora_cache.load_lora(pipe, adapter, cache_root=tmp_path, progress=False, enabled=how == "cached")
    model = pipe.transformer
    calls = {"pipe.unfuse_lora": pipe.unfuse_lora, "pipe.unload_lora_weights": pipe.unload_lora_weights,
             "pipe.disable_lora": pipe.disable_lora, "transformer.unfuse_lora": model.unfuse_lora,
             "transformer.unload_lora": model.unload_lora, "transformer.disable_lora": model.disable_lora}
    for name, call in calls.items():
        with pytest.raises(LoraHeldElsewhereError, match=r"still on: lora_cache applied it to 20 module\(s\) "
                                                         r"\((transformer\.)?blocks\.0\..*lora_cache\.unmerge\(pipe\."
                                                         r"transformer\).*set_pipeline_adapters\(pipe, \[\]"):
            call()
    base = tm.forward(tm.load_model("wan", folder), "wan")
    assert tm.relative(tm.forward(model, "wan"), base) > 1e-4  # the LoRA is on, as the error said
    if how == "run time":
        set_pipeline_adapters(pipe, [], files={"a": adapter}, cache_root=tmp_path)
    else:
        lora_cache.unmerge(model)
    assert torch.equal(tm.forward(model, "wan"), base)
    for name in ("pipe.unfuse_lora", "pipe.unload_lora_weights", "pipe.disable_lora", "transformer.unfuse_lora"):
        calls[name]()  # nothing held: they return, as on a pipeline that never had a LoRA


def test_a_wan_file_read_by_lora_caches_own_rules_goes_into_the_first_expert_of_a_wan22_pipeline(wan, tmp_path):
    """A ComfyUI Wan file diffusers' converter refuses (a ``head.head`` with its ``.alpha``) is
    read with lora_cache's Wan rules; on a Wan 2.2 pipeline a plain call means the first
    expert, as diffusers' load_lora_weights means it (every key could also name
    ``transformer_2``, and the call was refused as ambiguous)."""
    from hostmem.safetensors.mapping import save_file

    folder, _ = wan
    base = tm.weights(tm.load_model("wan", folder))
    dim = base["blocks.0.attn1.to_q.weight"].shape[0]
    gen = torch.Generator().manual_seed(9)
    tensors = {}
    for stem, shape in (("blocks.0.self_attn.q", base["blocks.0.attn1.to_q.weight"].shape),
                        ("head.head", base["proj_out.weight"].shape)):
        tensors[f"diffusion_model.{stem}.lora_down.weight"] = torch.randn(4, shape[1], generator=gen) * 0.05
        tensors[f"diffusion_model.{stem}.lora_up.weight"] = torch.randn(shape[0], 4, generator=gen) * 0.05
        tensors[f"diffusion_model.{stem}.alpha"] = torch.tensor(2.0)
    path = str(tmp_path / "comfy.safetensors")
    save_file(tensors, path)
    alone = tm.load_model("wan", folder)
    lora_cache.load_lora(alone, path, 0.7, cache_root=tmp_path / "alone", progress=False)
    assert _changed(alone, base) and dim
    pipe = _wan22(folder)
    lora_cache.load_lora(pipe, path, 0.7, cache_root=tmp_path / "pipe", progress=False)
    assert tm.weights(pipe.transformer).keys() == tm.weights(alone).keys()
    for name, value in tm.weights(alone).items():
        assert torch.equal(tm.weights(pipe.transformer)[name], value), name
    assert not _changed(pipe.transformer_2, base)


def test_a_file_naming_both_experts_merges_each_into_its_own(wan, tmp_path):
    """A file whose keys name ``transformer.`` and ``transformer_2.`` is merged into each expert
    it names (a plain call leaves the second expert out only for files that do not name it)."""
    from hostmem.safetensors.mapping import save_file

    folder, _ = wan
    base = tm.weights(tm.load_model("wan", folder))
    weight = base["blocks.0.attn1.to_q.weight"]
    gen, tensors = torch.Generator().manual_seed(1), {}
    for component in ("transformer", "transformer_2"):
        tensors[f"{component}.blocks.0.attn1.to_q.lora_A.weight"] = torch.randn(4, weight.shape[1], generator=gen) * 0.1
        tensors[f"{component}.blocks.0.attn1.to_q.lora_B.weight"] = torch.randn(weight.shape[0], 4, generator=gen) * 0.1
    path = str(tmp_path / "both.safetensors")
    save_file(tensors, path)
    pipe = _wan22(folder)
    lora_cache.load_lora(pipe, path, cache_root=tmp_path / "cache", progress=False)
    assert _changed(pipe.transformer, base) == _changed(pipe.transformer_2, base) == ["blocks.0.attn1.to_q.weight"]
    assert not torch.equal(pipe.transformer.blocks[0].attn1.to_q.weight, pipe.transformer_2.blocks[0].attn1.to_q.weight)
