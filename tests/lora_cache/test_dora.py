"""DoRA merged exactly as peft merges it: differential against peft's merge_and_unload on a
tiny model whose adapter peft's save_pretrained(use_dora=True) wrote."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import lora_cache
from lora_cache.targets.keys import KeyResolutionError
from tests.conftest import mapped_model

peft = pytest.importorskip("peft", reason="the peft comparisons need peft (pip install hostmem[test])")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(48, 64)
        self.b = nn.Linear(64, 32)
        self.c = nn.Linear(32, 32)  # not targeted

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _base(folder, dtype=torch.float32) -> Tiny:
    """The tiny model, every weight a read-only mapped view of a file written here."""
    torch.manual_seed(0)
    return mapped_model(Tiny().to(dtype), folder)


def _dora_adapter(folder, **config) -> tuple[str, dict[str, torch.Tensor]]:
    """A DoRA adapter saved by peft (magnitudes moved off their initial norms, as training
    does), and peft's own merge_and_unload of it into the fp32 model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = Tiny()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["a", "b"], use_dora=True, init_lora_weights=False, **config)
    wrapped = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(0.5 + torch.rand(param.shape, generator=gen))
    path = os.path.join(folder, "dora")
    wrapped.save_pretrained(path)
    merged = wrapped.merge_and_unload()
    return path, {k: v.detach().clone() for k, v in merged.state_dict().items()}


def test_dora_merges_as_peft_merges_it(tmp_path):
    path, reference = _dora_adapter(tmp_path)
    os.makedirs(tmp_path / "second")
    model = _base(tmp_path)
    stats = lora_cache.merge(model, [path], cache_root=tmp_path / "cache", progress=False)
    assert stats.built == 2 and stats.at_runtime == 0
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(weight, reference[name], rtol=2e-6, atol=1e-7, msg=name)
    assert not torch.allclose(model.a.weight, _base(tmp_path / "second").a.weight)  # it did change
    second = _base(tmp_path / "second")  # a second start (the same base bytes): the layers from the cache
    hit = lora_cache.merge(second, [path], cache_root=tmp_path / "cache", progress=False)
    assert (hit.hit, hit.built) == (2, 0) and torch.equal(second.a.weight, model.a.weight)


def test_dora_in_bf16_is_the_fp32_merge_rounded_once(tmp_path):
    path, reference = _dora_adapter(tmp_path)
    model = _base(tmp_path, torch.bfloat16)
    lora_cache.merge(model, [path], cache_root=tmp_path / "cache", progress=False)
    # the fp32 base and the bf16 one differ (the bf16 base is rounded), so compare with peft
    # merging into the bf16-rounded base in fp32, then rounded once
    from peft import PeftModel

    fp32_base = Tiny()
    fp32_base.load_state_dict({k: v.float() for k, v in _base(tmp_path / "b", torch.bfloat16).state_dict().items()})
    expected = PeftModel.from_pretrained(fp32_base, path).merge_and_unload().state_dict()
    for name in ("a.weight", "b.weight"):
        rounded = expected[name].bfloat16()
        close = (model.state_dict()[name] == rounded).float().mean()
        assert close > 0.999, (name, float(close))
        torch.testing.assert_close(model.state_dict()[name].float(), expected[name], rtol=2**-8, atol=0)


def test_dora_is_not_applied_at_run_time_and_never_onto_part_of_a_fused_weight(tmp_path):
    path, _ = _dora_adapter(tmp_path)
    model = nn.ModuleDict({"qkv": nn.Linear(48, 3 * 64), "b": nn.Linear(64, 32)})
    with pytest.raises(KeyResolutionError, match=r"DoRA magnitude vector placed on some rows of 'qkv\.weight'"):
        lora_cache.merge(model, [lora_cache.Adapter(path, rules=[(r"^.*\.a$", "qkv[0:64]")])], enabled=False)
    assert not lora_cache.is_merged(model)
    whole = nn.ModuleDict({"a": nn.Linear(48, 64), "b": nn.Linear(64, 32)})
    with pytest.raises(ValueError, match=r"cannot apply .*a DoRA term"):
        from lora_cache.orchestrate import plan_targets
        from lora_cache.placement.runtime_lora import apply_runtime

        apply_runtime(plan_targets(whole, [path])[0])


def _peft_pair(folder, first_dora: bool) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Two adapters on the same layers (a plain LoRA or a DoRA, then a DoRA), saved by peft,
    and peft's merge_and_unload of both into the fp32 model, in that order."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    wrapped, gen, paths = None, torch.Generator().manual_seed(7), []
    for name, (dora, alpha) in {"one": (first_dora, 6), "two": (True, 8)}.items():
        lora = LoraConfig(r=4, lora_alpha=alpha, target_modules=["a", "b"], use_dora=dora, init_lora_weights=False)
        if wrapped is None:
            wrapped = get_peft_model(Tiny(), lora, adapter_name=name)
        else:
            wrapped.add_adapter(name, lora)
        with torch.no_grad():
            for key, param in wrapped.named_parameters():
                if f"lora_magnitude_vector.{name}" in key:
                    param.mul_(0.5 + torch.rand(param.shape, generator=gen))
                elif f".{name}." in key and "lora_" in key:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    for name in ("one", "two"):
        wrapped.save_pretrained(os.path.join(folder, "saved"), selected_adapters=[name])
        paths.append(os.path.join(folder, "saved", name) if name != "default" else os.path.join(folder, "saved"))
    wrapped.base_model.set_adapter(["one", "two"])
    merged = wrapped.merge_and_unload(adapter_names=["one", "two"])
    return paths, {k: v.detach().clone() for k, v in merged.state_dict().items()}


@pytest.mark.parametrize("first", ["lora", "dora"])
def test_a_dora_after_another_adapter_merges_as_peft_merges_the_two(tmp_path, first):
    """peft takes each DoRA's norm over the base without the adapters merged before it, and
    scales what they made: ``W_k = m_k / ||W_0 + s_k B_k A_k|| * (W_{k-1} + s_k B_k A_k)``."""
    paths, reference = _peft_pair(tmp_path, first == "dora")
    for path in paths:
        assert os.path.exists(os.path.join(path, "adapter_config.json")), os.listdir(os.path.dirname(path))
    model = _base(tmp_path)
    stats = lora_cache.merge(model, paths, cache_root=tmp_path / "cache", progress=False)
    assert stats.built == 2
    for name, weight in model.state_dict().items():
        torch.testing.assert_close(weight, reference[name], rtol=2e-6, atol=1e-6, msg=name)
    from hostmem.vault import Vault

    (built,) = Vault(str(tmp_path / "cache")).combinations()  # keyed apart from builds made by the rule before
    assert built.inputs["merge_policy"].endswith("+dora-norm=base")
