"""lora_cache against the libraries diffusers users have: diffusers' load_lora_weights +
fuse_lora and peft's merge_and_unload, on two diffusers transformer classes built from
tiny configs, with adapters written by peft and by diffusers (with and without metadata)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem import account  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

KINDS = ["flux", "wan"]


@pytest.fixture(scope="module", params=KINDS)
def setup(request, tmp_path_factory):
    """A tiny model of each kind saved with save_pretrained, and one LoRA saved three ways."""
    root = tmp_path_factory.mktemp(request.param)
    model = tm.save_model(request.param, root / "model")
    return request.param, model, tm.write_adapters(request.param, model, root)


def _ours(kind, model_folder, adapters, cache_root, dtype=None, **kwargs):
    model = tm.load_model(kind, model_folder, dtype)
    stats = lora_cache.load_lora(model, adapters, cache_root=cache_root, progress=False, **kwargs)
    return model, stats


def _assert_close_fp32(ours: dict, reference: dict) -> None:
    assert ours.keys() == reference.keys()
    for name, ref in reference.items():
        torch.testing.assert_close(ours[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)


@pytest.mark.parametrize("adapter", ["diffusers_meta", "diffusers_plain", "peft"])
def test_fp32_merge_equals_diffusers_fuse_and_peft_merge(setup, adapter, tmp_path):
    kind, model_folder, adapters = setup
    ours, stats = _ours(kind, model_folder, adapters[adapter], tmp_path)
    assert stats.built == stats.layers > 0
    if adapter == "peft":
        reference = tm.peft_merged(kind, model_folder, adapters["peft"])
    else:
        reference = tm.diffusers_fused(kind, model_folder, adapters[adapter])
    _assert_close_fp32(tm.weights(ours), tm.weights(reference))
    base = tm.weights(tm.load_model(kind, model_folder))
    merged = [n for n, w in tm.weights(ours).items() if not torch.equal(w, base[n])]
    ledger = next(iter(account(ours).components.values())).parameters
    assert merged and all(ledger[n].residency.anonymous == 0 for n in merged)  # mapped cache files


def test_metadata_alpha_is_applied_and_equals_peft(setup, tmp_path):
    """Scale 2 from the metadata (alpha 16, r 8): the peft folder and the diffusers file agree;
    the file without metadata is scale 1 in diffusers and here alike."""
    kind, model_folder, adapters = setup
    base = tm.weights(tm.load_model(kind, model_folder))
    meta = tm.weights(_ours(kind, model_folder, adapters["diffusers_meta"], tmp_path / "a")[0])
    plain = tm.weights(_ours(kind, model_folder, adapters["diffusers_plain"], tmp_path / "b")[0])
    peft = tm.weights(tm.peft_merged(kind, model_folder, adapters["peft"]))
    _assert_close_fp32(meta, peft)
    changed = [n for n in base if not torch.equal(base[n], plain[n])]
    assert changed
    for name in changed:
        torch.testing.assert_close(meta[name] - base[name], 2 * (plain[name] - base[name]), rtol=1e-4, atol=1e-6)


def test_peft_rank_and_alpha_patterns_and_rslora_equal_peft_and_diffusers(setup, tmp_path):
    """Per-module ranks and alphas (adapter_config.json, and the same fields in diffusers'
    metadata) and rsLoRA's alpha / sqrt(r): both files merge as peft and diffusers merge them."""
    kind, model_folder, _ = setup
    patterns = {"rank_pattern": {"to_k": 4}, "alpha_pattern": {"to_v": 4, "to_out.0": 32}, "use_rslora": True}
    adapters = tm.write_adapters(kind, model_folder, tmp_path / "patterns", seed=3, **patterns)
    peft = tm.weights(tm.peft_merged(kind, model_folder, adapters["peft"]))
    _assert_close_fp32(tm.weights(_ours(kind, model_folder, adapters["peft"], tmp_path / "a")[0]), peft)
    fused = tm.weights(tm.diffusers_fused(kind, model_folder, adapters["diffusers_meta"]))
    _assert_close_fp32(fused, peft)
    _assert_close_fp32(tm.weights(_ours(kind, model_folder, adapters["diffusers_meta"], tmp_path / "b")[0]), peft)


def test_forward_is_as_close_as_the_two_references_are(setup, tmp_path):
    kind, model_folder, adapters = setup
    ours = tm.forward(_ours(kind, model_folder, adapters["diffusers_meta"], tmp_path)[0], kind)
    fused = tm.forward(tm.diffusers_fused(kind, model_folder, adapters["diffusers_meta"]), kind)
    merged = tm.forward(tm.peft_merged(kind, model_folder, adapters["peft"]), kind)
    between_references = tm.relative(fused, merged)
    assert tm.relative(ours, fused) <= max(between_references, 1e-6)
    assert tm.relative(ours, merged) <= max(between_references, 1e-6)


def test_bf16_merge_is_the_fp32_sum_rounded_once(setup, tmp_path):
    """A bf16 model: every merged weight is base + 2 * B @ A summed in fp32, rounded to bf16 once."""
    from hostmem.safetensors.mapping import load_readonly

    kind, _, adapters = setup
    model_folder = tm.save_model(kind, tmp_path / "bf16", torch.bfloat16)
    base = tm.weights(tm.load_model(kind, model_folder, torch.bfloat16))
    ours = tm.weights(_ours(kind, model_folder, adapters["diffusers_meta"], tmp_path / "cache", torch.bfloat16)[0])
    factors = load_readonly(f"{adapters['diffusers_meta']}/pytorch_lora_weights.safetensors")
    checked = 0
    for key, down in factors.items():
        if not key.endswith("lora_A.weight"):
            continue
        name = key.removeprefix("transformer.").removesuffix(".lora_A.weight") + ".weight"
        up = factors[key.replace("lora_A", "lora_B")]
        expected = base[name].float().addmm(up.float(), down.float(), alpha=tm.ALPHA / tm.RANK).bfloat16()
        assert torch.equal(ours[name], expected), name
        checked += 1
    assert checked == len([k for k in factors if k.endswith("lora_A.weight")]) > 0


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # peft, on diffusers' second adapter
def test_several_adapters_with_strengths_equal_diffusers_set_adapters_and_fuse(setup, tmp_path):
    kind, model_folder, adapters = setup
    second = tm.write_adapters(kind, model_folder, tmp_path / "second", seed=2)["diffusers_meta"]
    chosen = [(adapters["diffusers_meta"], 0.5), (second, -0.75)]
    ours, stats = _ours(kind, model_folder, chosen, tmp_path / "cache")
    assert len(stats.adapters) == 2
    _assert_close_fp32(tm.weights(ours), tm.weights(tm.diffusers_fused(kind, model_folder, chosen)))


def test_a_pipeline_merges_into_its_transformer_and_a_second_start_hits(setup, tmp_path):
    kind, model_folder, adapters = setup
    pipe = tm.pipeline(kind, tm.load_model(kind, model_folder))
    first = lora_cache.load_lora(pipe, adapters["diffusers_meta"], strength=0.8, cache_root=tmp_path, progress=False)
    again = tm.pipeline(kind, tm.load_model(kind, model_folder))
    second = lora_cache.load_lora(again, adapters["diffusers_meta"], strength=0.8, cache_root=tmp_path, progress=False)
    assert first.built == second.hit == second.layers > 0
    reference = tm.diffusers_fused(kind, model_folder, [(adapters["diffusers_meta"], 0.8)])
    _assert_close_fp32(tm.weights(again.transformer), tm.weights(reference))
    lora_cache.unmerge(again.transformer)
    _assert_close_fp32(tm.weights(again.transformer), tm.weights(tm.load_model(kind, model_folder)))


def test_what_load_lora_does_not_take_says_what_to_do(setup, tmp_path):
    kind, model_folder, adapters = setup
    with pytest.raises(TypeError, match=r"takes a diffusers pipeline or a diffusers model .* lora_cache.merge"):
        lora_cache.load_lora(torch.nn.Linear(4, 4), adapters["peft"], cache_root=tmp_path)
    with pytest.raises(lora_cache.AdapterError, match="not a state dict"):
        lora_cache.load_lora(tm.load_model(kind, model_folder), {"transformer.x.lora_A.weight": torch.ones(1)})
