"""kohya sd-scripts Flux adapters where diffusers' converter cannot take the model's sizes
(it splits a single block's linear1 at Flux-dev's widths): lora_cache reads them with its
own parser by itself. Held to diffusers' conversion at Flux-dev's widths (one block of
each kind, a model on the meta device: only names and shapes), and to the reference math
on a tiny model, merged through the cache."""

from __future__ import annotations

import logging
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="the kohya Flux fallback is diffusers' converter's")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import load_readonly, save_file  # noqa: E402
from lora_cache import Adapter  # noqa: E402
from lora_cache.adapters.kohya_flux_compat import read_kohya_flux  # noqa: E402
from lora_cache.adapters.read import open_adapter  # noqa: E402
from lora_cache.targets.keys import ModuleIndex, plan_deltas  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402

RANK = 4


def _bfl_sizes(dim: int, mlp: int, extra: bool) -> dict[str, tuple[int, int]]:
    """BFL module -> (rows of its up, columns of its down) for a Flux of width ``dim``."""
    sizes = {}
    for stream in ("img", "txt"):
        block = f"double_blocks_0_{stream}"
        sizes |= {f"{block}_attn_qkv": (3 * dim, dim), f"{block}_attn_proj": (dim, dim), f"{block}_mlp_0": (mlp, dim),
                  f"{block}_mlp_2": (dim, mlp), f"{block}_mod_lin": (6 * dim, dim)}
    sizes |= {"single_blocks_0_linear1": (3 * dim + mlp, dim), "single_blocks_0_linear2": (dim, dim + mlp),
              "single_blocks_0_modulation_lin": (3 * dim, dim)}
    if extra:  # Flux-dev's embedders and final linear (64 channels in and out, T5 4096, CLIP 768)
        sizes |= {"img_in": (dim, 64), "txt_in": (dim, 4096), "time_in_in_layer": (dim, 256),
                  "time_in_out_layer": (dim, dim), "vector_in_in_layer": (dim, 768),
                  "vector_in_out_layer": (dim, dim), "final_layer_linear": (64, dim),
                  "final_layer_adaLN_modulation_1": (2 * dim, dim)}
    return sizes


def _kohya(path, sizes: dict, sparse_linear1: bool = False) -> str:
    """A kohya Flux LoRA of ``sizes``; alphas vary by module, the first and the final layer's
    have none (alpha = rank). ``sparse_linear1``: linear1's up is block-diagonal over q, k, v and the MLP (one
    rank each), which diffusers converts by another path (its down chunked per target)."""
    gen = torch.Generator().manual_seed(5)
    tensors = {}
    for i, (name, (rows, cols)) in enumerate(sizes.items()):
        up = torch.randn(rows, RANK, generator=gen)
        if sparse_linear1 and name.endswith("linear1"):
            dim = cols
            for j, (start, stop) in enumerate([(0, dim), (dim, 2 * dim), (2 * dim, 3 * dim), (3 * dim, rows)]):
                keep = up[start:stop, j].clone()
                up[start:stop] = 0
                up[start:stop, j] = keep
        tensors[f"lora_unet_{name}.lora_down.weight"] = torch.randn(RANK, cols, generator=gen) / cols**0.5
        tensors[f"lora_unet_{name}.lora_up.weight"] = up
        if i and not name.startswith("final_layer"):  # diffusers drops final_layer alphas (see kohya_flux)
            tensors[f"lora_unet_{name}.alpha"] = torch.tensor(float(1 + i % 7))
    save_file(tensors, path)
    return os.fspath(path)


def _diffusers_products(path, probes: dict) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """diffusers' conversion of the file, applied to each module's probe: B @ (A @ x); and
    the rank it gave each module."""
    tensors = {k: v.clone() for k, v in load_readonly(path).items()}
    state, alphas = diffusers.FluxPipeline.lora_state_dict(tensors, return_alphas=True)
    assert not alphas  # kohya's converter folds the alphas into the matrices
    out, ranks = {}, {}
    for key, down in state.items():
        if key.endswith(".lora_A.weight"):
            param = key.removeprefix("transformer.").removesuffix(".lora_A.weight") + ".weight"
            up = state[key.replace(".lora_A.", ".lora_B.")]
            out[param], ranks[param] = up.double() @ (down.double() @ probes[param]), down.shape[0]
    return out, ranks


def _parser_products(path, shapes: dict, probes: dict) -> dict[str, torch.Tensor]:
    """This package's parser (the fallback's reader) planned on the model's shapes, applied
    to each module's probe: scale * up @ (down @ x)."""
    path, mapped, tensors = open_adapter(path)
    adapter = read_kohya_flux(path, tensors, mapped.metadata(), "compared with diffusers' converter")
    planned = plan_deltas([(adapter, Adapter(path))], ModuleIndex(shapes))
    return {param: sum(d.scale * (d.up.double() @ (d.down.double() @ probes[param])) for d in deltas)
            for param, deltas in planned.items()}  # norm_out.linear: its two halves, each padded to the height


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "block-sparse-linear1"])
def test_the_parser_equals_diffusers_conversion_at_flux_dev_widths(tmp_path, sparse):
    with torch.device("meta"):  # Flux-dev's widths, one block of each kind: names and shapes, no memory
        model = diffusers.FluxTransformer2DModel(num_layers=1, num_single_layers=1)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    path = _kohya(tmp_path / "dev.safetensors", _bfl_sizes(dim, 4 * dim, extra=True), sparse_linear1=sparse)
    gen = torch.Generator().manual_seed(9)
    probes = {name: torch.randn(shape[1], 3, generator=gen, dtype=torch.float64)
              for name, shape in shapes.items() if len(shape) == 2}
    (theirs, ranks), ours = _diffusers_products(path, probes), _parser_products(path, shapes, probes)
    assert ranks["single_transformer_blocks.0.proj_mlp.weight"] == (1 if sparse else RANK)  # diffusers' two paths
    assert ours.keys() == theirs.keys() and len(ours) == 28  # 7 + 7 double, 6 single, 8 outside blocks
    for name, reference in theirs.items():
        torch.testing.assert_close(ours[name], reference, rtol=1e-6, atol=1e-6 * float(reference.abs().max()), msg=name)


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tm.save_model("flux", tmp_path_factory.mktemp("flux") / "model")


def test_a_tiny_flux_falls_back_by_itself_and_says_so_once(flux, tmp_path, caplog):
    dim = tm.FLUX["num_attention_heads"] * tm.FLUX["attention_head_dim"]
    sizes = _bfl_sizes(dim, 4 * dim, extra=False) | {"final_layer_adaLN_modulation_1": (2 * dim, dim)}
    path = _kohya(tmp_path / "tiny.safetensors", sizes)
    model = tm.load_model("flux", flux)
    with caplog.at_level(logging.INFO, logger="lora_cache"):
        stats = lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
    said = [r for r in caplog.records if r.name == "lora_cache"]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "tiny.safetensors: diffusers' " in said[0].message  # its converter refuses the sizes, or the final layer
    assert "lora_cache's own parser" in said[0].message
    assert stats.built == stats.layers == 21
    _assert_reference_math(tm.weights(model), tm.weights(tm.load_model("flux", flux)), path, dim)
    again = lora_cache.load_lora(tm.load_model("flux", flux), path, cache_root=tmp_path / "cache", progress=False)
    assert again.hit == again.layers == 21 and again.cache_key == stats.cache_key
    pipe = tm.pipeline("flux", tm.load_model("flux", flux))  # converted for FluxPipeline: the same fallback
    lora_cache.load_lora(pipe, path, cache_root=tmp_path / "pipe-cache", progress=False)
    merged, through_pipe = tm.weights(model), tm.weights(pipe.transformer)
    assert all(torch.equal(through_pipe[n], merged[n]) for n in merged)


def _assert_reference_math(merged: dict, base: dict, path: str, dim: int) -> None:
    """Each target = base + alpha / rank * up[its rows] @ down, in float64 (fp32 weights);
    the final modulation's up with its halves swapped (BFL's shift, scale: diffusers' scale, shift)."""
    tensors = load_readonly(path)
    double, single = "transformer_blocks.0.", "single_transformer_blocks.0."
    splits = {"double_blocks_0_img_attn_qkv": [f"{double}attn.to_q", f"{double}attn.to_k", f"{double}attn.to_v"],
              "single_blocks_0_linear1": [f"{single}attn.to_q", f"{single}attn.to_k", f"{single}attn.to_v",
                                          f"{single}proj_mlp"],
              "single_blocks_0_linear2": [f"{single}proj_out"],
              "double_blocks_0_txt_mod_lin": [f"{double}norm1_context.linear"]}
    for bfl, modules in splits.items():
        up, down = tensors[f"lora_unet_{bfl}.lora_up.weight"], tensors[f"lora_unet_{bfl}.lora_down.weight"]
        alpha = tensors.get(f"lora_unet_{bfl}.alpha", torch.tensor(float(RANK)))
        start = 0
        for module in modules:
            rows = base[f"{module}.weight"].shape[0]
            expected = base[f"{module}.weight"].double() + float(alpha) / RANK * (
                up[start:start + rows].double() @ down.double())
            torch.testing.assert_close(merged[f"{module}.weight"].double(), expected, rtol=1e-6, atol=1e-6, msg=module)
            start += rows
        assert start == up.shape[0]
    up, down = (tensors[f"lora_unet_final_layer_adaLN_modulation_1.lora_{m}.weight"].double() for m in ("up", "down"))
    shift, scale = up.chunk(2)
    expected = base["norm_out.linear.weight"].double() + torch.cat([scale, shift]) @ down  # no alpha: alpha = rank
    torch.testing.assert_close(merged["norm_out.linear.weight"].double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_block", [False, True], ids=["final-layer-alone", "beside-a-block"])
def test_final_layer_loras_merge_at_alpha_over_rank_as_comfyui_merges_them(flux, tmp_path, caplog, with_block):
    """kohya's usual rank 16, alpha 1 on the final layer: diffusers' converter drops those
    alphas and names the modules outside the transformer, which merged them at scale 1
    (16x) alone and not at all beside a block module; ComfyUI merges them at alpha / rank,
    the modulation's halves swapped."""
    rank, alpha = 16, 1.0
    base = tm.weights(tm.load_model("flux", flux))
    targets = {"final_layer_adaLN_modulation_1": "norm_out.linear", "final_layer_linear": "proj_out"}
    if with_block:
        targets["double_blocks_0_img_attn_proj"] = "transformer_blocks.0.attn.to_out.0"
    gen, tensors = torch.Generator().manual_seed(3), {}
    for bfl, module in targets.items():
        rows, cols = base[f"{module}.weight"].shape
        tensors[f"lora_unet_{bfl}.lora_down.weight"] = torch.randn(rank, cols, generator=gen) * 0.15
        tensors[f"lora_unet_{bfl}.lora_up.weight"] = torch.randn(rows, rank, generator=gen) * 0.15
        tensors[f"lora_unet_{bfl}.alpha"] = torch.tensor(alpha)
    path = str(tmp_path / "final.safetensors")
    save_file(tensors, path)
    model = tm.load_model("flux", flux)
    with caplog.at_level(logging.INFO, logger="lora_cache"):
        lora_cache.load_lora(model, path, cache_root=tmp_path / "cache", progress=False)
    assert any("drops the alphas of lora_unet_final_layer" in r.message for r in caplog.records)
    merged = tm.weights(model)
    for bfl, module in targets.items():
        up = tensors[f"lora_unet_{bfl}.lora_up.weight"].double()
        if bfl == "final_layer_adaLN_modulation_1":
            shift, scale = up.chunk(2)
            up = torch.cat([scale, shift])
        expected = base[f"{module}.weight"].double() + alpha / rank * (up @ tensors[f"lora_unet_{bfl}.lora_down.weight"].double())
        torch.testing.assert_close(merged[f"{module}.weight"].double(), expected, rtol=1e-6, atol=1e-6, msg=module)


def test_a_row_axis_dora_scale_on_flux_qkv_merges_as_comfyui_merges_the_fused_weight(flux, tmp_path, caplog):
    """diffusers' converter drops a ``dora_scale`` (merged as plain LoRA, or refused); ComfyUI
    decomposes the fused BFL ``qkv`` weight, each row normed alone, which split by rows is
    the merge of ``to_q``, ``to_k`` and ``to_v`` with their rows of the scale."""
    from tests.conformance.corpus import comfyui_dora

    rank, alpha, strength = 8, 4.0, 0.7
    base = tm.weights(tm.load_model("flux", flux))
    parts = [f"transformer_blocks.0.attn.to_{p}.weight" for p in "qkv"]
    fused = torch.cat([base[p] for p in parts])
    gen = torch.Generator().manual_seed(5)
    up, down = torch.randn(fused.shape[0], rank, generator=gen) * 0.1, torch.randn(rank, fused.shape[1], generator=gen) * 0.1
    scale = fused.norm(dim=1, keepdim=True) * (0.9 + 0.2 * torch.rand(fused.shape[0], 1, generator=gen))
    stem = "lora_unet_double_blocks_0_img_attn_qkv"
    path = str(tmp_path / "dora.safetensors")
    save_file({f"{stem}.lora_up.weight": up, f"{stem}.lora_down.weight": down, f"{stem}.alpha": torch.tensor(alpha),
               f"{stem}.dora_scale": scale}, path)
    model = tm.load_model("flux", flux)
    with caplog.at_level(logging.INFO, logger="lora_cache"):
        lora_cache.load_lora(model, path, strength, cache_root=tmp_path / "cache", progress=False)
    assert any("drops the DoRA scales of 1 module(s)" in r.message for r in caplog.records)
    merged = tm.weights(model)
    expected = comfyui_dora(fused, up, down, alpha, scale, strength)
    got = torch.cat([merged[p] for p in parts]).double()
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)
