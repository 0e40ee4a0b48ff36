"""Flux and Wan files whose names diffusers' converters take only in part, on a diffusers
model: OneTrainer's kohya spelling of diffusers' own names (``lora_transformer_<module>``),
kohya files that also change the text encoder, and LyCORIS kinds (LoHa, LoKr) under a
family's original names. Each is held to ComfyUI's formula, computed here per layer:
``W + strength * alpha / rank * up @ down`` (a fused projection's rows split in order),
LoHa's Hadamard product and LoKr's Kronecker product at the same scale."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402
from tests.conformance.corpus_lycoris import comfyui_decompose, loha_delta, lokr_delta  # noqa: E402

FLUX_DIM = tm.FLUX["num_attention_heads"] * tm.FLUX["attention_head_dim"]


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return tm.save_model("flux", tmp_path_factory.mktemp("flux") / "model")


def _pair(tensors: dict, stem: str, rows: int, cols: int, rank: int, alpha: float | None, gen) -> torch.Tensor:
    """One kohya LoRA module written into ``tensors``; returns its ``alpha / rank * up @ down``."""
    down, up = torch.randn(rank, cols, generator=gen) / cols**0.5, torch.randn(rows, rank, generator=gen) * 0.1
    tensors[f"{stem}.lora_down.weight"], tensors[f"{stem}.lora_up.weight"] = down, up
    if alpha is not None:
        tensors[f"{stem}.alpha"] = torch.tensor(alpha)
    return (rank if alpha is None else alpha) / rank * up.double() @ down.double()


def _merged(kind: str, folder, adapter, cache_root, **options) -> dict[str, torch.Tensor]:
    model = tm.load_model(kind, folder)
    lora_cache.load_lora(model, adapter, cache_root=cache_root, progress=False, rounding="merge", **options)
    return tm.weights(model)


def _held_to(merged: dict, base: dict, deltas: dict, strength: float) -> None:
    """Every weight ``deltas`` names is its base plus ``strength`` times its delta; no other weight changed."""
    for name, weight in merged.items():
        expected = base[name].double() + strength * deltas[name] if name in deltas else base[name].double()
        torch.testing.assert_close(weight.double(), expected, rtol=1e-6, atol=1e-6, msg=name)


_ONETRAINER = {  # diffusers' module -> (rank, alpha); the converter knows only the attention modules
    "transformer_blocks.0.attn.to_q": (4, 4.0), "transformer_blocks.0.ff.net.0.proj": (4, 2.0),
    "transformer_blocks.0.norm1.linear": (2, 1.0), "transformer_blocks.0.ff_context.net.2": (4, 8.0),
    "single_transformer_blocks.0.attn.to_k": (4, 8.0), "single_transformer_blocks.0.proj_mlp": (3, 2.0),
    "single_transformer_blocks.0.proj_out": (4, 1.0), "single_transformer_blocks.0.norm.linear": (4, 1.0),
}


def test_onetrainer_flux_names_merge_every_module_as_comfyui_does(flux, tmp_path):
    """diffusers' converter names each non-attention module its block, where they replace one
    another (2 of these 8 would merge); the file is read with lora_cache's reader instead."""
    base = tm.weights(tm.load_model("flux", flux))
    gen, tensors, deltas = torch.Generator().manual_seed(4), {}, {}
    for module, (rank, alpha) in _ONETRAINER.items():
        rows, cols = base[f"{module}.weight"].shape
        stem = "lora_transformer_" + module.replace(".", "_")
        deltas[f"{module}.weight"] = _pair(tensors, stem, rows, cols, rank, alpha, gen)
    path = tmp_path / "onetrainer.safetensors"
    save_file(tensors, path)
    _held_to(_merged("flux", flux, os.fspath(path), tmp_path / "cache", strength=0.7), base, deltas, 0.7)


def test_onetrainer_flux_attention_only_still_goes_through_diffusers(flux, tmp_path):
    """A file diffusers' converter takes whole is still its: the merge equals load_lora_weights + fuse_lora."""
    base = tm.weights(tm.load_model("flux", flux))
    gen, tensors = torch.Generator().manual_seed(5), {}
    for module in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v"):
        rows, cols = base[f"{module}.weight"].shape
        _pair(tensors, "lora_transformer_" + module.replace(".", "_"), rows, cols, 4, 2.0, gen)
    path = os.fspath(tmp_path / "attention.safetensors")
    save_file(tensors, path)
    model = tm.load_model("flux", flux)
    files = lora_cache.adapters.read_adapters(model, [lora_cache.Adapter(path)])
    assert files[0].key_extras["converter"].startswith("diffusers ")
    reference = tm.weights(tm.diffusers_fused("flux", flux, path))
    for name, weight in _merged("flux", flux, path, tmp_path / "cache").items():
        torch.testing.assert_close(weight, reference[name], rtol=1e-6, atol=1e-6, msg=name)


def _kohya_flux_with_clip(path, single: bool) -> tuple[str, dict]:
    """A kohya Flux file as sd-scripts writes it with the text encoder trained too: BFL names
    and ``lora_te1_`` (CLIP) keys. ``single``: a single block's ``linear1`` too, which
    diffusers' converter splits at Flux-dev's widths (the tiny model's make it refuse)."""
    gen, tensors, deltas = torch.Generator().manual_seed(10), {}, {}
    qkv = _pair(tensors, "lora_unet_double_blocks_0_img_attn_qkv", 3 * FLUX_DIM, FLUX_DIM, 4, 2.0, gen)
    for i, module in enumerate(("to_q", "to_k", "to_v")):
        deltas[f"transformer_blocks.0.attn.{module}.weight"] = qkv[i * FLUX_DIM:(i + 1) * FLUX_DIM]
    if single:
        mlp = FLUX_DIM * 4
        linear1 = _pair(tensors, "lora_unet_single_blocks_0_linear1", 3 * FLUX_DIM + mlp, FLUX_DIM, 4, 8.0, gen)
        for i, module in enumerate(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")):
            rows = slice(i * FLUX_DIM, (i + 1) * FLUX_DIM if i < 3 else None)
            deltas[f"single_transformer_blocks.0.{module}.weight"] = linear1[rows]
    _pair(tensors, "lora_te1_text_model_encoder_layers_0_self_attn_q_proj", 32, 32, 4, 4.0, gen)
    save_file(tensors, path, metadata={"ss_network_module": "networks.lora_flux"})
    return os.fspath(path), deltas


@pytest.mark.parametrize("single", [False, True], ids=["diffusers-converts", "lora_cache-reads"])
def test_text_encoder_keys_merged_into_the_transformer_alone_are_named_on_either_path(flux, tmp_path, single):
    """diffusers' converter takes the double block alone, and its CLIP keys are named in a
    warning (the transformer was merged alone by choice); with a single block it refuses
    the tiny widths and lora_cache's kohya Flux rules read the file: the same warning."""
    path, deltas = _kohya_flux_with_clip(tmp_path / "kohya.safetensors", single)
    base = tm.weights(tm.load_model("flux", flux))
    with pytest.warns(UserWarning, match=r"[23] key\(s\) change text_encoder, which is not the model merged into "
                                         r"\(it has transformer\): (lora_te1_|text_encoder\.)"):
        merged = _merged("flux", flux, path, tmp_path / "cache")
    _held_to(merged, base, deltas, 1.0)
    with pytest.warns(UserWarning, match=r"change text_encoder, which is not the model merged into"):
        _held_to(_merged("flux", flux, path, tmp_path / "cache"), base, deltas, 1.0)  # planned from its record


def _randn(gen, *shape, std: float = 0.3) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def test_loha_and_lokr_under_kohya_flux_names_merge_as_comfyui_does(flux, tmp_path):
    """sd-scripts with LyCORIS on Flux: a LoKr on the fused ``img_attn_qkv`` (its rows split over
    q, k, v) and a LoHa on ``img_attn_proj``, both with ``.alpha``, read with the Flux rules."""
    gen, stem = torch.Generator().manual_seed(6), "lora_unet_double_blocks_0_img_attn_"
    lokr = {"lokr_w1": _randn(gen, 4, 4, std=1.0), "lokr_w2_a": _randn(gen, 24, 2), "lokr_w2_b": _randn(gen, 2, 8),
            "alpha": torch.tensor(1.0)}
    loha = {f"hada_w{n}_{s}": _randn(gen, *shape) for n in (1, 2) for s, shape in (("a", (32, 4)), ("b", (4, 32)))}
    loha["alpha"] = torch.tensor(2.0)
    path = tmp_path / "lyco_flux.safetensors"
    save_file({f"{stem}{module}.{part}": tensor for module, parts in (("qkv", lokr), ("proj", loha))
               for part, tensor in parts.items()}, path)
    qkv = lokr_delta(lokr, (3 * FLUX_DIM, FLUX_DIM))
    deltas = {f"transformer_blocks.0.attn.{module}.weight": qkv[i * FLUX_DIM:(i + 1) * FLUX_DIM]
              for i, module in enumerate(("to_q", "to_k", "to_v"))}
    deltas["transformer_blocks.0.attn.to_out.0.weight"] = loha_delta(loha, (FLUX_DIM, FLUX_DIM))
    base = tm.weights(tm.load_model("flux", flux))
    _held_to(_merged("flux", flux, os.fspath(path), tmp_path / "cache", strength=0.8), base, deltas, 0.8)


def test_lycoris_kinds_under_wan_original_names_merge_as_comfyui_does(tmp_path):
    """ComfyUI's own trainer and musubi-style files on Wan: a LoHa in ComfyUI's names, a LoKr of
    whole halves (scale 1) in kohya's, a LoRA with LyCORIS's ``dora_scale`` (each input column)."""
    folder = tm.save_model("wan", tmp_path / "model")
    base = tm.weights(tm.load_model("wan", folder))
    dim, gen = tm.WAN["num_attention_heads"] * tm.WAN["attention_head_dim"], torch.Generator().manual_seed(7)
    loha = {f"hada_w{n}_{s}": _randn(gen, *shape) for n in (1, 2) for s, shape in (("a", (dim, 4)), ("b", (4, dim)))}
    loha["alpha"] = torch.tensor(2.0)
    lokr = {"lokr_w1": _randn(gen, 4, 4, std=1.0), "lokr_w2": _randn(gen, dim // 4, dim // 4, std=0.1)}
    tensors = {f"diffusion_model.blocks.0.self_attn.q.{part}": t for part, t in loha.items()}
    tensors |= {f"lora_unet_blocks_0_cross_attn_k.{part}": t for part, t in lokr.items()}
    lora = _pair(tensors, "lora_unet_blocks_1_self_attn_o", dim, dim, 4, 2.0, gen)
    weight = base["blocks.1.attn1.to_out.0.weight"]
    scale = tensors["lora_unet_blocks_1_self_attn_o.dora_scale"] = (weight.double() + lora).norm(dim=0,
                                                                                               keepdim=True).float() * 1.1
    path = tmp_path / "lyco_wan.safetensors"
    save_file(tensors, path)
    deltas = {"blocks.0.attn1.to_q.weight": loha_delta(loha, (dim, dim)),
              "blocks.0.attn2.to_k.weight": lokr_delta(lokr, (dim, dim))}
    merged = _merged("wan", folder, os.fspath(path), tmp_path / "cache", strength=0.6)
    dora = comfyui_decompose(weight, lora, scale, 0.6)
    torch.testing.assert_close(merged.pop("blocks.1.attn1.to_out.0.weight").double(), dora, rtol=1e-5, atol=1e-6)
    _held_to(merged, {k: v for k, v in base.items() if k != "blocks.1.attn1.to_out.0.weight"}, deltas, 0.6)


def test_a_diffusion_pipe_wan_folder_merges_as_diffusers_merges_its_file(tmp_path):
    """diffusion-pipe saves ``adapter_model.safetensors`` in ComfyUI's Wan names with peft's
    ``adapter_config.json`` beside it (lora_alpha = r): the folder and the file both merge."""
    import json

    folder = tm.save_model("wan", tmp_path / "model")
    base = tm.weights(tm.load_model("wan", folder))
    gen, tensors, deltas = torch.Generator().manual_seed(12), {}, {}
    for block, (original, module) in enumerate((("self_attn.q", "attn1.to_q"), ("cross_attn.o", "attn2.to_out.0"))):
        rows, cols = base[f"blocks.{block}.{module}.weight"].shape
        down, up = torch.randn(4, cols, generator=gen) / cols**0.5, torch.randn(rows, 4, generator=gen) * 0.1
        stem = f"diffusion_model.blocks.{block}.{original}"
        tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = down, up
        deltas[f"blocks.{block}.{module}.weight"] = up.double() @ down.double()
    epoch = tmp_path / "epoch1"
    epoch.mkdir()
    save_file(tensors, epoch / "adapter_model.safetensors")
    (epoch / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["q", "o"]}))
    for given in (epoch, epoch / "adapter_model.safetensors"):
        _held_to(_merged("wan", folder, os.fspath(given), tmp_path / "cache"), base, deltas, 1.0)


def test_a_wan_file_the_converter_refuses_keeps_the_placement_of_its_norm_and_modulation_diffs(tmp_path):
    """ComfyUI's Wan names with ``head.head`` and ``time_projection.1`` alphas (diffusers' Wan
    converter leaves them in its state dict and refuses the file) beside full diffs of
    ``norm3`` (diffusers' ``norm2``), ``self_attn.norm_q`` and ``modulation`` (its
    ``scale_shift_table``): the Wan rules read the factors, and the diffs land where the
    converter's path puts them."""
    folder = tm.save_model("wan", tmp_path / "model")
    base = tm.weights(tm.load_model("wan", folder))
    gen, tensors, deltas = torch.Generator().manual_seed(13), {}, {}
    for original, module, alpha in (("blocks.0.self_attn.q", "blocks.0.attn1.to_q", 2.0),
                                    ("time_projection.1", "condition_embedder.time_proj", 2.0),
                                    ("head.head", "proj_out", 8.0)):
        rows, cols = base[f"{module}.weight"].shape
        deltas[f"{module}.weight"] = _pair(tensors, f"diffusion_model.{original}", rows, cols, 4, alpha, gen)
    for original, param, part in (("blocks.0.norm3", "blocks.0.norm2.weight", "diff"),
                                  ("blocks.0.norm3", "blocks.0.norm2.bias", "diff_b"),
                                  ("blocks.0.self_attn.norm_q", "blocks.0.attn1.norm_q.weight", "diff"),
                                  ("blocks.1.modulation", "blocks.1.scale_shift_table", "diff")):
        diff = torch.randn(base[param].shape, generator=gen) * 0.1
        tensors[f"diffusion_model.{original}.{part}"], deltas[param] = diff, diff.double()
    path = os.fspath(tmp_path / "wan_mixed.safetensors")
    save_file(tensors, path)
    for _ in range(2):  # converted (refused, read with the rules), then planned from its record
        _held_to(_merged("wan", folder, path, tmp_path / "cache", strength=0.6), base, deltas, 0.6)
