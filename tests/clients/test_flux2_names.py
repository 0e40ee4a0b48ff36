"""Flux.2 files in BFL's names (ai-toolkit's ``diffusion_model.double_blocks.0.img_attn.qkv``,
kohya's ``lora_unet_double_blocks_0_img_attn_qkv``) on diffusers' Flux.2 transformer.

diffusers 0.42 converts a LoRA and a LoKr in these names and nothing else of LyCORIS's; it
drops kohya's final modulation and puts ai-toolkit's on ``norm_out.linear`` with its halves
unswapped, where its own checkpoint converter swaps the weight's (BFL's shift, scale;
diffusers' scale, shift). ComfyUI merges each of these into BFL's weights. Each merge is held
to that formula, a fused projection's rows split in order, and where diffusers converts the
file, to ``load_lora_weights`` + ``fuse_lora``."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers comparisons need diffusers (pip install hostmem[test])")
pytest.importorskip("peft", reason="the diffusers comparisons need peft (pip install hostmem[test])")

import lora_cache  # noqa: E402
from hostmem.safetensors.mapping import save_file  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402
from tests.conformance.corpus_lycoris import loha_delta, lokr_delta  # noqa: E402

_BFL = {  # BFL's module -> diffusers' weights its rows fall on, in order
    "double_blocks.0.img_attn.qkv": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                                     "transformer_blocks.0.attn.to_v"],
    "double_blocks.0.txt_attn.qkv": ["transformer_blocks.0.attn.add_q_proj", "transformer_blocks.0.attn.add_k_proj",
                                     "transformer_blocks.0.attn.add_v_proj"],
    "double_blocks.0.img_attn.proj": ["transformer_blocks.0.attn.to_out.0"],
    "double_blocks.0.img_mlp.0": ["transformer_blocks.0.ff.linear_in"],
    "double_blocks.0.txt_mlp.2": ["transformer_blocks.0.ff_context.linear_out"],
    "single_blocks.0.linear1": ["single_transformer_blocks.0.attn.to_qkv_mlp_proj"],
    "single_blocks.0.linear2": ["single_transformer_blocks.0.attn.to_out"],
}


@pytest.fixture(scope="module")
def flux2(tmp_path_factory):
    return tm.save_model("flux2", tmp_path_factory.mktemp("flux2") / "model")


def _shape(base: dict, targets: list[str]) -> tuple[int, int]:
    return sum(base[f"{t}.weight"].shape[0] for t in targets), base[f"{targets[0]}.weight"].shape[1]


def _split(delta: torch.Tensor, base: dict, targets: list[str]) -> dict[str, torch.Tensor]:
    rows = [base[f"{t}.weight"].shape[0] for t in targets]
    return {f"{t}.weight": part for t, part in zip(targets, delta.split(rows))}


def _ours(folder, adapter, cache_root, strength: float) -> dict[str, torch.Tensor]:
    model = tm.load_model("flux2", folder)
    lora_cache.load_lora(tm.pipeline("flux2", model), os.fspath(adapter), strength=strength, cache_root=cache_root,
                         progress=False, rounding="merge")
    return tm.weights(model)


def _held_to(merged: dict, base: dict, deltas: dict, strength: float) -> None:
    for name, weight in merged.items():
        expected = base[name].double() + strength * deltas[name] if name in deltas else base[name].double()
        torch.testing.assert_close(weight.double(), expected, rtol=1e-6, atol=1e-6, msg=name)


def _diffusers(folder, adapter, strength: float) -> dict[str, torch.Tensor]:
    model = tm.load_model("flux2", folder)
    pipe = tm.pipeline("flux2", model)
    pipe.load_lora_weights(os.fspath(adapter))
    pipe.fuse_lora(lora_scale=strength)
    return tm.weights(model)


def _as_split(weights: dict, base: dict) -> dict[str, torch.Tensor]:
    """diffusers' weights with a projection it fused for a LoKr (``to_qkv``) cut back into its parts."""
    out = dict(weights)
    for fused, parts in (("transformer_blocks.0.attn.to_qkv", _BFL["double_blocks.0.img_attn.qkv"]),
                         ("transformer_blocks.0.attn.to_added_qkv", _BFL["double_blocks.0.txt_attn.qkv"])):
        if f"{fused}.weight" in out:
            out.update(_split(out.pop(f"{fused}.weight"), base, parts))
            out.pop(f"{fused}.bias", None)
    return {k: v for k, v in out.items() if k in base}


def _lokr(tensors: dict, stem: str, rows: int, cols: int, gen) -> torch.Tensor:
    """A LoKr module whose right half is a rank-2 pair with ``.alpha``; returns its change."""
    parts = {"lokr_w1": torch.randn(4, 4, generator=gen) * 0.3,
             "lokr_w2_a": torch.randn(rows // 4, 2, generator=gen) * 0.1,
             "lokr_w2_b": torch.randn(2, cols // 4, generator=gen) * 0.1, "alpha": torch.tensor(1.0)}
    tensors.update({f"{stem}.{k}": v for k, v in parts.items()})
    return lokr_delta(parts, (rows, cols))


def test_a_lokr_in_bfl_names_merges_as_diffusers_fuses_it(flux2, tmp_path):
    """Refused before (no rule named these modules); diffusers fuses q, k, v for it."""
    base = tm.weights(tm.load_model("flux2", flux2))
    gen, tensors, deltas = torch.Generator().manual_seed(11), {}, {}
    for module, targets in _BFL.items():
        deltas.update(_split(_lokr(tensors, f"diffusion_model.{module}", *_shape(base, targets), gen), base, targets))
    path = tmp_path / "lokr_bfl.safetensors"
    save_file(tensors, path)
    ours = _ours(flux2, path, tmp_path / "cache", 0.8)
    _held_to(ours, base, deltas, 0.8)
    theirs = _as_split(_diffusers(flux2, path, 0.8), base)
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name].double(), weight.double(), rtol=1e-5, atol=1e-6, msg=name)


def test_a_loha_in_kohyas_spelling_of_bfl_names_merges_as_comfyui_does(flux2, tmp_path):
    base = tm.weights(tm.load_model("flux2", flux2))
    gen, tensors, deltas = torch.Generator().manual_seed(12), {}, {}
    for module, targets in _BFL.items():
        rows, cols = _shape(base, targets)
        parts = {"hada_w1_a": torch.randn(rows, 2, generator=gen) * 0.1, "hada_w1_b": torch.randn(2, cols, generator=gen),
                 "hada_w2_a": torch.randn(rows, 2, generator=gen) * 0.1, "hada_w2_b": torch.randn(2, cols, generator=gen),
                 "alpha": torch.tensor(1.0)}
        tensors.update({f"lora_unet_{module.replace('.', '_')}.{k}": v for k, v in parts.items()})
        deltas.update(_split(loha_delta(parts, (rows, cols)), base, targets))
    path = tmp_path / "loha_kohya.safetensors"
    save_file(tensors, path)
    _held_to(_ours(flux2, path, tmp_path / "cache", 1.0), base, deltas, 1.0)


def _pair(tensors: dict, stem: str, rows: int, cols: int, names: tuple[str, str], alpha: float | None, gen):
    down, up = torch.randn(4, cols, generator=gen) / cols**0.5, torch.randn(rows, 4, generator=gen) * 0.05
    tensors[f"{stem}.{names[0]}.weight"], tensors[f"{stem}.{names[1]}.weight"] = down, up
    if alpha is not None:
        tensors[f"{stem}.alpha"] = torch.tensor(alpha)
    return (4 if alpha is None else alpha) / 4 * up.double() @ down.double()


@pytest.mark.parametrize("layout", ["ai-toolkit", "kohya"])
def test_the_final_modulations_halves_are_swapped_onto_norm_out(flux2, tmp_path, layout):
    """ai-toolkit's: diffusers put BFL's shift rows on its scale rows; kohya's: diffusers dropped it."""
    base = tm.weights(tm.load_model("flux2", flux2))
    gen, tensors, deltas = torch.Generator().manual_seed(13), {}, {}
    names, alpha = (("lora_A", "lora_B"), None) if layout == "ai-toolkit" else (("lora_down", "lora_up"), 2.0)

    def stem(module: str) -> str:
        return f"diffusion_model.{module}" if layout == "ai-toolkit" else f"lora_unet_{module.replace('.', '_')}"

    rows, cols = base["norm_out.linear.weight"].shape
    change = _pair(tensors, stem("final_layer.adaLN_modulation.1"), rows, cols, names, alpha, gen)
    shift, scale = change.chunk(2)
    deltas["norm_out.linear.weight"] = torch.cat([scale, shift])
    targets = _BFL["double_blocks.0.img_attn.qkv"]
    deltas.update(_split(_pair(tensors, stem("double_blocks.0.img_attn.qkv"), *_shape(base, targets), names, alpha,
                               gen), base, targets))
    path = tmp_path / f"{layout}.safetensors"
    save_file(tensors, path)
    _held_to(_ours(flux2, path, tmp_path / "cache", 0.9), base, deltas, 0.9)
