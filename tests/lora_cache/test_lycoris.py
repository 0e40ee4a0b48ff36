"""LyCORIS files merged by the native reader: ``dora_scale`` (its DoRA) as ComfyUI merges it,
on both axes its shape names, and the "full" algorithm's ``.diff`` / ``.diff_b`` as
``W += strength * diff``. The references are written here from the formats' documentation
(ComfyUI's ``weight_decompose`` in tests/conformance/corpus.py, LyCORIS's ``FullModule``), in
float64, independently of lora_cache's row-block merge."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import lora_cache
from hostmem.safetensors.mapping import load_readonly
from lora_cache import read_adapter
from lora_cache.targets.keys import KeyResolutionError
from tests.conformance.corpus import comfyui_dora  # ComfyUI's weight_decompose, written from it
from tests.conftest import mapped_model, write_safetensors

RANK, ALPHA = 4, 2.0


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(48, 64)  # out != in: the axis is never ambiguous
        self.sq = nn.Linear(32, 32)  # square: only dora_scale's shape tells the axis
        self.conv = nn.Conv2d(8, 16, 3)


def _base(folder, dtype=torch.float32) -> Tiny:
    """The tiny model, every weight a read-only mapped view of a file written here."""
    torch.manual_seed(0)
    return mapped_model(Tiny().to(dtype), folder)


def _lycoris_dora(folder, on_out: bool) -> str:
    """A LyCORIS LoCon file with DoRA: ``lycoris_<module>.lora_down/up.weight``, ``.alpha`` and
    ``.dora_scale`` of shape (out, 1[, 1, 1]) (``wd_on_out``) or (1, in[, 1, 1])."""
    gen, tensors = torch.Generator().manual_seed(3), {}
    for name, (rows, cols, kernel) in {"a": (64, 48, ()), "sq": (32, 32, ()), "conv": (16, 8, (3, 3))}.items():
        stem = f"lycoris_{name}"
        ones = (1,) * len(kernel)
        tensors[f"{stem}.lora_down.weight"] = torch.randn(RANK, cols, *kernel, generator=gen) / cols**0.5
        tensors[f"{stem}.lora_up.weight"] = torch.randn(rows, RANK, *ones, generator=gen) * 0.1
        tensors[f"{stem}.alpha"] = torch.tensor(ALPHA)
        shape = (rows, 1, *ones) if on_out else (1, cols, *ones)
        tensors[f"{stem}.dora_scale"] = 0.5 + torch.rand(shape, generator=gen)
    path = os.path.join(folder, f"dora_{'out' if on_out else 'in'}.safetensors")
    write_safetensors(path, tensors)
    return path


@pytest.mark.parametrize("strength", [1.0, 0.6])
@pytest.mark.parametrize("on_out", [False, True], ids=["input-axis", "output-axis"])
def test_dora_scale_merges_as_comfyui_merges_it(tmp_path, on_out, strength):
    path = _lycoris_dora(tmp_path, on_out)
    assert read_adapter(path).format == "lycoris"
    model = _base(tmp_path / "m")
    stats = lora_cache.merge(model, [lora_cache.Adapter(path, strength)], cache_root=tmp_path / "cache",
                             progress=False)
    assert stats.built == 3
    base, file = _base(tmp_path / "b").state_dict(), load_readonly(path)
    for name in ("a", "sq", "conv"):
        stem = f"lycoris_{name}"
        expected = comfyui_dora(base[f"{name}.weight"], file[f"{stem}.lora_up.weight"],
                                 file[f"{stem}.lora_down.weight"], ALPHA, file[f"{stem}.dora_scale"], strength)
        merged = model.state_dict()[f"{name}.weight"]
        torch.testing.assert_close(merged.double(), expected, rtol=1e-6, atol=1e-6 * float(expected.abs().max()))
        assert not torch.allclose(merged, base[f"{name}.weight"])
    again = _base(tmp_path / "again")  # a second start: every layer a hit, the same bytes
    hit = lora_cache.merge(again, [lora_cache.Adapter(path, strength)], cache_root=tmp_path / "cache", progress=False)
    assert (hit.hit, hit.built) == (3, 0)
    assert all(torch.equal(w, model.state_dict()[n]) for n, w in again.state_dict().items())


def test_another_strength_is_another_combination(tmp_path):
    """The strength of a LyCORIS DoRA sits outside its scale: the cache key must still see it."""
    path = _lycoris_dora(tmp_path, on_out=False)
    first, second = _base(tmp_path / "1"), _base(tmp_path / "2")
    lora_cache.merge(first, [lora_cache.Adapter(path, 1.0)], cache_root=tmp_path / "cache", progress=False)
    other = lora_cache.merge(second, [lora_cache.Adapter(path, 0.5)], cache_root=tmp_path / "cache", progress=False)
    assert other.built == 3 and not torch.equal(first.a.weight, second.a.weight)


def test_dora_scale_in_bf16_is_the_fp32_merge_rounded_once(tmp_path):
    path = _lycoris_dora(tmp_path, on_out=False)
    model = _base(tmp_path / "m", torch.bfloat16)
    lora_cache.merge(model, [path], cache_root=tmp_path / "cache", progress=False)
    base, file = _base(tmp_path / "b", torch.bfloat16).state_dict(), load_readonly(path)
    expected = comfyui_dora(base["a.weight"], file["lycoris_a.lora_up.weight"], file["lycoris_a.lora_down.weight"],
                             ALPHA, file["lycoris_a.dora_scale"], 1.0)
    torch.testing.assert_close(model.a.weight.double(), expected, rtol=2**-8, atol=0)


def test_a_dora_scale_of_the_wrong_size_or_alone_is_refused(tmp_path):
    path = _lycoris_dora(tmp_path, on_out=False)
    tensors = dict(load_readonly(path))
    tensors["lycoris_a.dora_scale"] = torch.ones(1, 40)
    write_safetensors(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(lora_cache.UnsupportedAdapterError, match=r"lycoris_a.*40 values does not fit the 48 input"):
        lora_cache.merge(_base(tmp_path / "m"), [tmp_path / "bad.safetensors"], enabled=False)
    write_safetensors(tmp_path / "alone.safetensors", {"lycoris_a.dora_scale": torch.ones(64, 1)})
    with pytest.raises(lora_cache.AdapterError, match=r"'lycoris_a.dora_scale' has no LoRA pair beside it"):
        read_adapter(tmp_path / "alone.safetensors")


def test_dora_scale_on_part_of_a_fused_weight_is_refused(tmp_path):
    path = _lycoris_dora(tmp_path, on_out=True)
    model = nn.ModuleDict({"qkv": nn.Linear(48, 3 * 64), "sq": nn.Linear(32, 32), "conv": nn.Conv2d(8, 16, 3)})
    with pytest.raises(KeyResolutionError, match=r"DoRA scale placed on some rows of 'qkv\.weight'"):
        lora_cache.merge(model, [lora_cache.Adapter(path, rules=[(r"^lycoris_a$", "qkv[0:64]")])], enabled=False)


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_a_row_axis_dora_scale_on_a_fused_weight_splits_over_the_models_own_weights(tmp_path, strength):
    """A DoRA scale of shape (out, 1) normed each row alone: ComfyUI's merge of a fused qkv
    weight, split by rows, is the merge of each of q, k and v with its rows of the scale and
    of the up matrix (the column axis, which norms the fused columns, stays refused)."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(0)
    model = nn.ModuleDict({n: nn.Linear(48, 64, bias=False) for n in ("q", "k", "v")})
    fused = torch.cat([model[n].weight.detach() for n in ("q", "k", "v")])
    up, down = torch.randn(192, 4, generator=gen) * 0.2, torch.randn(4, 48, generator=gen) / 48**0.5
    scale = fused.norm(dim=1, keepdim=True) * (0.9 + 0.2 * torch.rand(192, 1, generator=gen))
    path = write_safetensors(tmp_path / "qkv.safetensors", {"lycoris_qkv.lora_up.weight": up,
                                                            "lycoris_qkv.lora_down.weight": down,
                                                            "lycoris_qkv.alpha": torch.tensor(2.0),
                                                            "lycoris_qkv.dora_scale": scale})
    expected = comfyui_dora(fused, up, down, 2.0, scale, strength)
    lora_cache.merge(model, [lora_cache.Adapter(path, strength, rules=[(r"^lycoris_qkv$", ["q", "k", "v"])])],
                     enabled=False, progress=False)
    got = torch.cat([model[n].weight.detach() for n in ("q", "k", "v")])
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=1e-7)
    columns = write_safetensors(tmp_path / "cols.safetensors", {"lycoris_qkv.lora_up.weight": up,
                                                                "lycoris_qkv.lora_down.weight": down,
                                                                "lycoris_qkv.dora_scale": torch.ones(1, 48)})
    fresh = nn.ModuleDict({n: nn.Linear(48, 64, bias=False) for n in ("q", "k", "v")})
    with pytest.raises(KeyResolutionError, match=r"DoRA scale placed on some rows of 'q\.weight'"):
        lora_cache.merge(fresh, [lora_cache.Adapter(columns, rules=[(r"^lycoris_qkv$", ["q", "k", "v"])])],
                         enabled=False, progress=False)


def test_lycoris_full_weights_merge_as_w_plus_strength_diff(tmp_path):
    """LyCORIS's "full" algorithm saves the trained weight minus the original (``.diff``) and
    the bias's (``.diff_b``), under its ``lycoris_`` names."""
    gen = torch.Generator().manual_seed(7)
    diffs = {"a.weight": torch.randn(64, 48, generator=gen), "a.bias": torch.randn(64, generator=gen),
             "conv.weight": torch.randn(16, 8, 3, 3, generator=gen)}
    keys = {"a.weight": "lycoris_a.diff", "a.bias": "lycoris_a.diff_b", "conv.weight": "lycoris_conv.diff"}
    path = write_safetensors(tmp_path / "full.safetensors", {keys[n]: d * 0.01 for n, d in diffs.items()})
    assert read_adapter(path).format == "lycoris"
    model = _base(tmp_path / "m")
    lora_cache.merge(model, [lora_cache.Adapter(path, 0.7)], cache_root=tmp_path / "cache", progress=False)
    base = _base(tmp_path / "b").state_dict()
    for name, weight in model.state_dict().items():
        expected = base[name].double() + (0.7 * 0.01 * diffs[name].double() if name in diffs else 0)
        torch.testing.assert_close(weight.double(), expected, rtol=1e-6, atol=1e-6, msg=name)


def test_lycoris_norm_modules_merge_as_its_norm_module_adds_them(tmp_path):
    """LyCORIS's norm modules (``.w_norm``, ``.b_norm`` on a LayerNorm) are differences its
    ``NormModule`` adds at the multiplier, as ComfyUI adds them: merged as full diffs, never
    refused (they were, as a kind whose change is no sum of terms)."""
    lycoris_norms = pytest.importorskip("lycoris.modules.norms", reason="the reference is LyCORIS's own NormModule")
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(0)
    model = nn.ModuleDict({"norm": nn.LayerNorm(48), "a": nn.Linear(48, 64)})
    w_norm, b_norm = torch.randn(48, generator=gen) * 0.01, torch.randn(48, generator=gen) * 0.01
    path = write_safetensors(tmp_path / "norm.safetensors", {"lycoris_norm.w_norm": w_norm, "lycoris_norm.b_norm": b_norm})
    with torch.no_grad():
        reference = lycoris_norms.NormModule.make_module_from_state_dict("lycoris_norm", model.norm, w_norm, b_norm)
    with torch.no_grad():
        weight, bias = reference.make_weight(scale=0.7)
    lora_cache.merge(model, [lora_cache.Adapter(path, 0.7)], enabled=False, progress=False)
    torch.testing.assert_close(model.norm.weight.detach(), weight.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(model.norm.bias.detach(), bias.detach(), rtol=1e-6, atol=1e-7)


def test_a_magnitude_vector_of_input_columns_is_never_normed_by_rows(tmp_path):
    """peft's magnitude is one value per row; a (1, in) one (LyCORIS's input-axis dora_scale
    under peft's name, as a converter may pass it on) is refused even where in == out."""
    gen = torch.Generator().manual_seed(2)
    path = write_safetensors(tmp_path / "m.safetensors", {
        "sq.lora_A.weight": torch.randn(RANK, 32, generator=gen),
        "sq.lora_B.weight": torch.randn(32, RANK, generator=gen),
        "sq.lora_magnitude_vector": torch.ones(1, 32)})
    refusal = r"'sq.lora_magnitude_vector' has shape \(1, 32\): magnitudes of input"
    with pytest.raises(KeyResolutionError, match=refusal):
        lora_cache.merge(_base(tmp_path / "m"), [path], enabled=False)


@pytest.mark.parametrize("dora, dim", [("peft", 1), ("comfyui-rows", 1), ("comfyui-columns", 0)])
def test_a_dora_term_on_a_part_that_lacks_its_norms_is_refused(dora, dim):
    """A tensor-parallel part without the rows or columns a DoRA term's norms span is never
    merged alone (its norms would be a part's)."""
    from lora_cache.compute.merge_math import Delta, Scratch
    from lora_cache.ranks.tp_shards import Shard
    from lora_cache.ranks.tp_shards.shard_math import shard_merged

    up, down = torch.ones(32, RANK), torch.ones(RANK, 32)
    delta = Delta("f.safetensors: 'sq'", up, down, 0.5, magnitude=torch.ones(32), dora=dora)
    part = torch.zeros(32, 16) if dim == 1 else torch.zeros(16, 32)
    with pytest.raises(lora_cache.UnsupportedAdapterError, match=rf"'sq': a DoRA term on a part .* along dim {dim}"):
        shard_merged(part, [delta], Shard(dim, 0, 2), part.clone(), Scratch(torch.device("cpu")))
