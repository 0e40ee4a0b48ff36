"""kohya sd-scripts Flux adapters (BFL names, fused qkv, ``.alpha``; ``ss_network_alpha`` no alpha) on a
diffusers Flux model: through diffusers' own converter, and through this package's reader with
fused-target rules, both held to diffusers' load_lora_weights + fuse_lora."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import load_readonly, save_file  # noqa: E402
from lora_cache import Adapter  # noqa: E402
from lora_cache.adapters import read_adapters  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

DIM = tm.FLUX["num_attention_heads"] * tm.FLUX["attention_head_dim"]
RANK = 4
# BFL module -> (rows, the diffusers modules its rows split over)
BFL = {
    "double_blocks_0_img_attn_qkv": (3 * DIM, ["attn.to_q", "attn.to_k", "attn.to_v"]),
    "double_blocks_0_txt_attn_qkv": (3 * DIM, ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"]),
    "double_blocks_0_img_attn_proj": (DIM, ["attn.to_out.0"]),
}
RULES = [
    (rf"^lora_unet_double_blocks_(\d+)_{part}$", [rf"transformer_blocks.\1.{m}" for m in modules])
    for part, (_, modules) in ((k.split("_", 3)[3], v) for k, v in BFL.items())
]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tm.save_model("flux", tmp_path_factory.mktemp("flux") / "model")


def _kohya(path, alphas: dict | None, network_alpha: str | None) -> str:
    """A kohya sd-scripts Flux LoRA: ``lora_unet_<BFL name>.lora_down/lora_up.weight`` (+ ``.alpha``)."""
    gen = torch.Generator().manual_seed(3)
    tensors = {}
    for name, (rows, _) in BFL.items():
        tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(RANK, DIM, generator=gen) / DIM**0.5
        tensors[f"lora_unet_{name}.lora_up.weight"] = torch.randn(rows, RANK, generator=gen)
        if alphas is not None and name in alphas:
            tensors[f"lora_unet_{name}.alpha"] = torch.tensor(float(alphas[name]))
    metadata = {"ss_network_dim": str(RANK), **({"ss_network_alpha": network_alpha} if network_alpha else {})}
    save_file(tensors, path, metadata=metadata)
    return os.fspath(path)


def _merged(flux, adapter, cache_root, stats: list | None = None):
    model = tm.load_model("flux", flux)
    done = lora_cache.load_lora(model, adapter, cache_root=cache_root, progress=False)
    if stats is not None:
        stats.append(done)
    return tm.weights(model)


def _close(ours: dict, reference: dict) -> None:
    for name, ref in reference.items():
        torch.testing.assert_close(ours[name], ref, rtol=1e-6, atol=1e-6 * float(ref.abs().max()), msg=name)


def test_kohya_bfl_names_through_diffusers_conversion_equal_diffusers(flux, tmp_path):
    path = _kohya(tmp_path / "k.safetensors", {n: 2.0 for n in BFL}, network_alpha="2")
    reference = tm.weights(tm.diffusers_fused("flux", flux, path))
    _close(_merged(flux, path, tmp_path / "cache"), reference)


def test_kohya_fused_qkv_through_the_native_reader_and_split_rules_equals_diffusers(flux, tmp_path):
    """The fused-target rules reproduce diffusers' own kohya conversion: up rows split per target."""
    path = _kohya(tmp_path / "k.safetensors", {"double_blocks_0_img_attn_qkv": 1.0, "double_blocks_0_txt_attn_qkv": 8.0,
                                                "double_blocks_0_img_attn_proj": 2.0}, network_alpha=None)
    reference = tm.weights(tm.diffusers_fused("flux", flux, path))
    native = Adapter(path, convert="native", rules=RULES)
    _close(_merged(flux, native, tmp_path / "cache"), reference)


def test_ss_network_alpha_is_no_alpha_on_either_path(flux, tmp_path):
    """kohya's ss_network_alpha is a record of the training command: modules without ``.alpha``
    merge at alpha = rank on both paths (diffusers' converter and kohya's
    create_network_from_weights both default it to the rank), as a file that writes the rank
    into every module does."""
    implicit = _kohya(tmp_path / "implicit.safetensors", None, network_alpha="1")
    explicit = _kohya(tmp_path / "explicit.safetensors", {n: float(RANK) for n in BFL}, network_alpha=None)
    reference = tm.weights(tm.diffusers_fused("flux", flux, explicit))
    _close(tm.weights(tm.diffusers_fused("flux", flux, implicit)), reference)
    _close(_merged(flux, implicit, tmp_path / "cache"), reference)
    _close(_merged(flux, Adapter(implicit, convert="native", rules=RULES), tmp_path / "cache"), reference)


def test_the_converter_is_part_of_the_cache_key(flux, tmp_path):
    """The same file converted by diffusers and read natively (same key rules) are two keys."""
    path = _kohya(tmp_path / "k.safetensors", {n: 2.0 for n in BFL}, network_alpha=None)
    model = tm.load_model("flux", flux)
    files = read_adapters(model, [Adapter(path), Adapter(path, convert="native")])
    assert files[0].key_extras["converter"].startswith("diffusers ") and files[1].key_extras == {}
    stats = []
    _merged(flux, Adapter(path, rules=RULES), tmp_path / "cache", stats)
    _merged(flux, Adapter(path, rules=RULES, convert="native"), tmp_path / "cache", stats)
    assert stats[0].built == stats[1].built > 0 and stats[0].cache_key != stats[1].cache_key


def test_a_file_neither_converter_reads_names_the_file_and_the_way_out(flux, tmp_path):
    """diffusers refuses linear1 at a tiny width; its parser fallback does not know Chroma's
    distilled guidance layer: the error names the file, the key (it is in the file), and the way out."""
    gen = torch.Generator().manual_seed(1)
    odd = tmp_path / "odd.safetensors"
    save_file({"lora_unet_single_blocks_0_linear1.lora_down.weight": torch.randn(RANK, DIM, generator=gen),
               "lora_unet_single_blocks_0_linear1.lora_up.weight": torch.randn(7 * DIM, RANK, generator=gen),
               "lora_unet_distilled_guidance_layer_in_proj.lora_down.weight": torch.randn(RANK, 64, generator=gen),
               "lora_unet_distilled_guidance_layer_in_proj.lora_up.weight": torch.randn(DIM, RANK, generator=gen)},
              odd)
    refused = (r"(?s)odd.safetensors: 1 adapter key\(s\) match no module of the model:\s+"
               r"lora_unet_distilled_guidance_layer_in_proj\.lora_down\.weight.*Add a key rule")
    with pytest.raises(lora_cache.KeyResolutionError, match=refused):
        _merged(flux, os.fspath(odd), tmp_path / "cache")
    path = tmp_path / "linear1.safetensors"
    save_file({k: v for k, v in load_readonly(odd).items() if "linear1" in k}, path)
    linear1 = (r"^lora_unet_single_blocks_(\d+)_linear1$", [rf"single_transformer_blocks.\1.{m}" for m in
                                                            ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")])
    merged = _merged(flux, Adapter(path, convert="native", rules=[linear1]), tmp_path / "cache")
    base = tm.weights(tm.load_model("flux", flux))
    up, down = load_readonly(path)["lora_unet_single_blocks_0_linear1.lora_up.weight"], load_readonly(path)[
        "lora_unet_single_blocks_0_linear1.lora_down.weight"]
    for i, module in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
        name = f"single_transformer_blocks.0.{module}.weight"
        rows = slice(i * DIM, (i + 1) * DIM) if i < 3 else slice(3 * DIM, 7 * DIM)
        expected = base[name].double() + up[rows].double() @ down.double()  # no alpha: scale 1
        torch.testing.assert_close(merged[name].double(), expected, rtol=1e-6, atol=1e-6)
