"""LyCORIS's factored changes (LoHa, LoKr, LoCon's Tucker core) through every path a merge
takes: cached and in place alike, on rows of a fused weight, on a tensor-parallel part, with
a ``dora_scale`` on the input axis, keyed apart from LoRA; and refused where their parts do
not fit. Held to LyCORIS's definitions written in tests/conformance/corpus_lycoris.py, in
float64, independently of lora_cache's row blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lora_cache
from hostmem.safetensors.mapping import load_readonly
from lora_cache import AdapterError, KeyResolutionError, read_adapter
from lora_cache.orchestrate import plan_targets
from tests.conformance.corpus_lycoris import comfyui_decompose, loha_delta, lokr_delta, tucker_locon_delta
from tests.conftest import mapped_model, write_safetensors

STD = 0.15


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(48, 64)
        self.b = nn.Linear(48, 32)
        self.conv = nn.Conv2d(8, 16, 3)


def _base(folder, dtype=torch.float32) -> Tiny:
    torch.manual_seed(0)
    return mapped_model(Tiny().to(dtype), folder)


def _randn(gen, *shape, std=STD):
    return torch.randn(*shape, generator=gen) * std


def _mixed(gen) -> dict[str, dict[str, torch.Tensor]]:
    """One module of each kind: a LoHa on ``a``, a LoKr on ``b``, a Tucker LoCon on ``conv``."""
    loha = {f"hada_w{n}_{s}": _randn(gen, *shape) for n in (1, 2) for s, shape in (("a", (64, 4)), ("b", (4, 48)))}
    lokr = {"lokr_w1": _randn(gen, 4, 4, std=0.5), "lokr_w2_a": _randn(gen, 8, 2), "lokr_w2_b": _randn(gen, 2, 12)}
    tucker = {"lora_down.weight": _randn(gen, 4, 8, 1, 1), "lora_mid.weight": _randn(gen, 4, 4, 3, 3),
              "lora_up.weight": _randn(gen, 16, 4, 1, 1, std=0.02)}
    return {"a": loha | {"alpha": torch.tensor(2.0)}, "b": lokr | {"alpha": torch.tensor(1.0)},
            "conv": tucker | {"alpha": torch.tensor(2.0)}}


_DELTAS = {"a": loha_delta, "b": lokr_delta, "conv": tucker_locon_delta}


def _write(folder, modules: dict[str, dict], name: str = "lyco.safetensors") -> str:
    return write_safetensors(folder / name, {f"lycoris_{m}.{p}": t for m, parts in modules.items()
                                             for p, t in parts.items()})


def test_cached_and_in_place_merges_give_the_same_bytes(tmp_path):
    """One math: the cached path, a hit, and the in-place path of a bf16 model agree bit for bit,
    and all are LyCORIS's change rounded once."""
    modules = _mixed(torch.Generator().manual_seed(1))
    path = _write(tmp_path, modules)
    cached = _base(tmp_path / "c", torch.bfloat16)
    built = lora_cache.merge(cached, [lora_cache.Adapter(path, 0.8)], cache_root=tmp_path / "cache", progress=False,
                             rounding="merge")
    assert built.built == 3
    torch.manual_seed(0)
    in_place = Tiny().to(torch.bfloat16)
    lora_cache.merge(in_place, [lora_cache.Adapter(path, 0.8)], enabled=False, progress=False, rounding="merge")
    again = _base(tmp_path / "h", torch.bfloat16)
    hit = lora_cache.merge(again, [lora_cache.Adapter(path, 0.8)], cache_root=tmp_path / "cache", progress=False,
                           rounding="merge")
    assert hit.hit == 3 and hit.built == 0
    base = _base(tmp_path / "b", torch.bfloat16).state_dict()
    for name, parts in modules.items():
        weight = base[f"{name}.weight"]
        expected = weight.double() + 0.8 * _DELTAS[name](parts, tuple(weight.shape))
        merged = cached.state_dict()[f"{name}.weight"]
        assert torch.equal(merged, in_place.state_dict()[f"{name}.weight"]), name
        assert torch.equal(merged, again.state_dict()[f"{name}.weight"]), name
        torch.testing.assert_close(merged.double(), expected, rtol=2**-8, atol=0, msg=name)
        assert not torch.equal(merged, weight), name


def test_a_loha_and_a_lora_of_one_shape_are_keyed_apart(tmp_path):
    """The canonical form names the kind and every part: a LoHa never keys as a LoRA whose
    factors have its shapes, nor as a LoKr."""
    from lora_cache.key.canonical_key import adapter_forms

    gen = torch.Generator().manual_seed(2)
    loha = _write(tmp_path, {"a": _mixed(gen)["a"]}, "loha.safetensors")
    lora = _write(tmp_path, {"a": {"lora_up.weight": _randn(gen, 64, 4), "lora_down.weight": _randn(gen, 4, 48),
                                   "alpha": torch.tensor(2.0)}}, "lora.safetensors")
    lokr = _write(tmp_path, {"a": {"lokr_w1": _randn(gen, 4, 4), "lokr_w2_a": _randn(gen, 16, 4),
                                   "lokr_w2_b": _randn(gen, 4, 12), "alpha": torch.tensor(2.0)}}, "lokr.safetensors")
    forms = set()
    for path in (loha, lora, lokr):
        targets, _ = plan_targets(_base(tmp_path / "m"), [path])
        forms.add(adapter_forms({t.name: t.deltas for t in targets}, [path])[0])
    assert len(forms) == 3


def test_two_lohas_of_one_shape_with_other_values_never_share_a_combination(tmp_path):
    """The key covers what a file means, values included: a second LoHa with the first one's
    shapes and alpha but other values is built, not served the first one's merged bytes."""
    first = _write(tmp_path, {"a": _mixed(torch.Generator().manual_seed(3))["a"]}, "first.safetensors")
    second = _write(tmp_path, {"a": _mixed(torch.Generator().manual_seed(4))["a"]}, "second.safetensors")
    merged = {}
    for path in (first, second):
        model = _base(tmp_path / ("model-" + path.rsplit("/", 1)[-1]), torch.bfloat16)
        stats = lora_cache.merge(model, [lora_cache.Adapter(path, 1.0)], cache_root=tmp_path / "cache",
                                 progress=False, rounding="merge")
        assert stats.built == 1 and stats.hit == 0, stats
        merged[path] = model.state_dict()["a.weight"]
    assert not torch.equal(merged[first], merged[second])


def test_factored_changes_split_over_modules_and_land_on_rows_of_a_fused_weight(tmp_path):
    """A LoHa or LoKr trained on a fused projection splits by rows over separate modules (its
    row factors' rows in order), and one on a separate projection lands on rows of a fused
    weight, as a LoRA pair does (lora_cache.targets.keys)."""
    modules = _mixed(torch.Generator().manual_seed(3))
    path = _write(tmp_path, {"a": modules["a"], "b": modules["b"]})
    torch.manual_seed(0)
    model = nn.ModuleDict({"q": nn.Linear(48, 40), "k": nn.Linear(48, 24), "qkv": nn.Linear(48, 96)})
    before = {n: w.clone() for n, w in model.state_dict().items()}
    rules = [(r"^lycoris_a$", ["q", "k"]), (r"^lycoris_b$", "qkv[64:96]")]
    lora_cache.merge(model, [lora_cache.Adapter(path, rules=rules)], enabled=False, progress=False, rounding="merge")
    loha, lokr = loha_delta(modules["a"], (64, 48)), lokr_delta(modules["b"], (32, 48))
    expected = {"q.weight": before["q.weight"].double() + loha[:40], "k.weight": before["k.weight"].double() + loha[40:],
                "qkv.weight": before["qkv.weight"].double() + torch.cat([torch.zeros(64, 48, dtype=torch.float64), lokr])}
    for name, value in expected.items():
        torch.testing.assert_close(model.state_dict()[name].double(), value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("dim", [0, 1], ids=["rows", "columns"])
def test_a_tensor_parallel_part_is_that_part_of_the_whole_merge(tmp_path, dim):
    """A part of a LoHa's, LoKr's or Tucker LoCon's layer is summed as the whole layer is:
    the same bytes."""
    from lora_cache.targets.keys import ModuleIndex, plan_deltas
    from lora_cache.compute.merge_math import Scratch, merged_weight
    from lora_cache.tp_shards import Shard
    from lora_cache.tp_shards.shard_math import shard_merged

    path = _write(tmp_path, _mixed(torch.Generator().manual_seed(4)))
    index = ModuleIndex({"a.weight": (64, 48), "b.weight": (32, 48), "conv.weight": (16, 8, 3, 3)})
    planned = plan_deltas([(read_adapter(path), lora_cache.Adapter(path))], index)
    scratch = Scratch(torch.device("cpu"))
    for name, deltas in planned.items():
        whole = torch.randn(*deltas[0].shape).to(torch.bfloat16)
        merged = merged_weight(whole, deltas, whole.clone(), scratch)
        part = whole.chunk(2, dim=dim)[1].contiguous()
        out = shard_merged(part, deltas, Shard(dim, 1, 2), part.clone(), scratch)
        assert torch.equal(out, merged.chunk(2, dim=dim)[1]), name
        assert not torch.equal(merged, whole), name


def test_a_dora_scale_on_the_input_axis_of_a_loha_conv_merges_as_comfyui_merges_it(tmp_path):
    gen = torch.Generator().manual_seed(5)
    parts = {f"hada_w{n}_{s}": _randn(gen, *shape) for n in (1, 2) for s, shape in (("a", (16, 4)), ("b", (4, 72)))}
    base = _base(tmp_path / "b").state_dict()
    norms = base["conv.weight"].transpose(0, 1).reshape(8, -1).norm(dim=1).reshape(1, 8, 1, 1)
    parts |= {"alpha": torch.tensor(2.0), "dora_scale": norms * (1 + 0.05 * torch.randn(norms.shape, generator=gen))}
    path = _write(tmp_path, {"conv": parts})
    model = _base(tmp_path / "m")
    lora_cache.merge(model, [lora_cache.Adapter(path, 0.7)], cache_root=tmp_path / "cache", progress=False)
    weight = base["conv.weight"]
    expected = comfyui_decompose(weight, loha_delta(parts, (16, 8, 3, 3)), parts["dora_scale"], 0.7)
    torch.testing.assert_close(model.conv.weight.double(), expected, rtol=1e-6, atol=1e-7)
    assert not torch.equal(model.conv.weight, weight)


def test_a_factored_layer_is_never_kept_at_run_time(tmp_path):
    """Run-time LoRA adds pairs and diffs; a LoHa term is not one, so a lossy LoHa layer is
    merged anyway, and the line says so."""
    from lora_cache.switching.runtime_lora import unsupported_reason

    path = _write(tmp_path, {"a": _mixed(torch.Generator().manual_seed(6))["a"]})
    targets, _ = plan_targets(_base(tmp_path / "m"), [path])
    assert "a LoHa term" in unsupported_reason(targets[0])


def _parts_of(path) -> dict:
    return dict(load_readonly(path))


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("lycoris_a.hada_w2_b"), r"'lycoris_a.hada_w1_a' has no hada_w2_b beside it"),
    (lambda t: t.update({"lycoris_a.hada_w2_b": torch.ones(3, 48)}), r"hada_w2_a' and .*hada_w2_b' do not multiply"),
    (lambda t: t.update({"lycoris_b.lokr_w1_a": torch.ones(4, 3), "lycoris_b.lokr_w1_b": torch.ones(3, 4)}),
     r"lokr_w1, or lokr_w1_a and lokr_w1_b, and not both"),
    (lambda t: t.update({"lycoris_conv.lora_down.weight": torch.ones(4, 8, 3, 3)}),
     r"lora_mid.weight'.s lora_up and lora_down have kernels"),
    (lambda t: t.update({"lycoris_a.lora_up.weight": torch.ones(64, 4)}), r"mix LyCORIS kinds or other parts"),
])
def test_factors_that_do_not_fit_together_are_refused_naming_the_key(tmp_path, change, message):
    tensors = _parts_of(_write(tmp_path, _mixed(torch.Generator().manual_seed(7))))
    change(tensors)
    bad = write_safetensors(tmp_path / "bad.safetensors", tensors)
    with pytest.raises(AdapterError, match=message):
        read_adapter(bad)


def test_a_lokr_whose_two_pairs_have_different_ranks_is_refused(tmp_path):
    """LyCORIS would scale it by the first pair's rank, ComfyUI by the second's."""
    gen = torch.Generator().manual_seed(8)
    path = _write(tmp_path, {"b": {"lokr_w1_a": _randn(gen, 4, 2), "lokr_w1_b": _randn(gen, 2, 4),
                                   "lokr_w2_a": _randn(gen, 8, 3), "lokr_w2_b": _randn(gen, 3, 12)}})
    with pytest.raises(AdapterError, match=r"have ranks 2 and 3; LyCORIS and ComfyUI would scale it"):
        read_adapter(path)


def test_a_factored_change_of_another_shape_is_refused_naming_both(tmp_path):
    gen = torch.Generator().manual_seed(9)
    parts = {f"hada_w{n}_{s}": _randn(gen, *shape) for n in (1, 2) for s, shape in (("a", (64, 4)), ("b", (4, 40)))}
    path = _write(tmp_path, {"a": parts})
    with pytest.raises(KeyResolutionError, match=r"'lycoris_a.hada_w1_a' gives a change of shape \(64, 40\) but the "
                                                 r"model's 'a.weight' has shape \(64, 48\)"):
        lora_cache.merge(_base(tmp_path / "m"), [path], enabled=False)


def test_an_unmatched_factored_module_is_named_by_a_factor_and_its_kind_not_its_alpha(tmp_path):
    """Its ``.alpha`` sorts first among its keys, and says nothing of the module being a LoHa or a LoKr."""
    modules = _mixed(torch.Generator().manual_seed(11))
    path = _write(tmp_path, {"nowhere_a": modules["a"], "nowhere_b": modules["b"]})
    with pytest.raises(KeyResolutionError) as caught:
        lora_cache.merge(_base(tmp_path / "m"), [path], enabled=False)
    listed = str(caught.value).splitlines()[1:3]
    assert [line.strip() for line in listed] == ["lycoris_nowhere_a.hada_w1_a (LoHa)", "lycoris_nowhere_b.lokr_w1 (LoKr)"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU merge is tested above)")
def test_a_merge_summed_on_the_gpu_is_the_cpu_merge_up_to_one_rounding(tmp_path):
    """The GPU sums a layer in one block, with its own matrix kernels: the same change, rounded once."""
    from lora_cache.targets.keys import ModuleIndex, plan_deltas
    from lora_cache.compute.merge_math import Scratch, merged_weight

    path = _write(tmp_path, _mixed(torch.Generator().manual_seed(10)))
    index = ModuleIndex({"a.weight": (64, 48), "b.weight": (32, 48), "conv.weight": (16, 8, 3, 3)})
    for name, deltas in plan_deltas([(read_adapter(path), lora_cache.Adapter(path))], index).items():
        whole = torch.randn(*deltas[0].shape).to(torch.bfloat16)
        on_cpu = merged_weight(whole, deltas, whole.clone(), Scratch(torch.device("cpu")))
        on_gpu = merged_weight(whole, deltas, whole.clone(), Scratch(torch.device("cuda")))
        torch.testing.assert_close(on_gpu.double(), on_cpu.double(), rtol=2**-7, atol=0, msg=name)
