"""Run-time LoRA: the base stays mapped and untouched, the output matches a fresh merge."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lora_cache
from hostmem import account
from hostmem.safetensors.mapping import load_readonly
from lora_cache.placement.layers import AddressSpace
from lora_cache.orchestrate import plan_targets
from lora_cache.placement.runtime_lora import CHILD, apply_runtime, remove_runtime, runtime_bytes
from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter

# ----------------------------------------------------------------- shared helpers


class Stack(nn.Module):
    """Linear layers with a nonlinearity between them: a mixed-up model shows in the output."""

    def __init__(self, dim: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return x


def stack_model(folder, dim: int = 64, depth: int = 3, dtype=torch.float32, seed: int = 0) -> Stack:
    """A :class:`Stack` whose every weight is a read-only mapped view of a file it wrote."""
    torch.manual_seed(seed)
    model = Stack(dim, depth).to(dtype)
    path = write_safetensors(os.path.join(folder, "base.safetensors"),
                             {k: v.detach() for k, v in model.state_dict().items()})
    for name, tensor in load_readonly(path).items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    return model


def stack_adapter(path, dim: int, depth: int, seed: int, rank: int = 4, dtype=torch.float32, fmt="comfyui") -> str:
    """A rank-``rank`` adapter on every layer of a :class:`Stack`, small enough to keep outputs sane."""
    changes = {}
    for i in range(depth):
        change = lora_change(dim, dim, rank, seed * 100 + i)
        changes[f"layers.{i}"] = {"up": (change["up"] * 0.1).to(dtype), "down": change["down"].to(dtype)}
    return write_adapter(path, fmt, changes)


def fresh_merge(folder, adapters, dim, depth, dtype) -> Stack:
    """The same base loaded again and merged in place: the reference a switch must equal."""
    os.makedirs(folder, exist_ok=True)
    model = stack_model(folder, dim, depth, dtype)
    lora_cache.merge(model, adapters, cache_root=None, enabled=False, progress=False)
    return model


def _bases(model) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_runtime_output_matches_a_fresh_merge_and_the_base_is_untouched(tmp_path, dtype, tol):
    dim, depth = 64, 3
    model = stack_model(tmp_path, dim, depth, dtype)
    adapters = [(stack_adapter(tmp_path / "a.safetensors", dim, depth, 1, dtype=dtype), 0.8),
                (stack_adapter(tmp_path / "b.safetensors", dim, depth, 2, dtype=dtype), 0.5)]
    x = torch.randn(5, dim).to(dtype)
    base_out, before = model(x), _bases(model)
    targets, _ = plan_targets(model, adapters)
    assert apply_runtime(targets) == 0  # same dtype: every factor is a view of its file
    runtime_out = model(x)
    reference = fresh_merge(tmp_path / "ref", adapters, dim, depth, dtype)(x)
    assert torch.allclose(runtime_out.float(), reference.float(), rtol=tol, atol=tol)
    assert not torch.equal(runtime_out, base_out)
    assert _bases(model) == before  # not one parameter was replaced or written
    space = AddressSpace()
    assert all(not space.is_writable(p) for p in model.parameters())  # still the read-only mapping
    assert remove_runtime(model) == depth
    assert torch.equal(model(x), base_out)
    assert not any(CHILD in n for n, _ in model.named_modules())


def test_factors_are_mapped_views_or_counted_copies_and_the_ledger_sees_them(tmp_path):
    dim, depth, rank = 64, 2, 4
    model = stack_model(tmp_path, dim, depth, torch.float32)
    path = stack_adapter(tmp_path / "a.safetensors", dim, depth, 1, rank=rank, dtype=torch.bfloat16)
    targets, _ = plan_targets(model, [path])
    copied = apply_runtime(targets)  # bf16 factors on an fp32 layer: cast once, at apply time
    factor_bytes = depth * 2 * rank * dim * 4
    assert copied == factor_bytes == runtime_bytes(model)
    buffers = {n for n, _ in model.named_buffers()}
    assert buffers == {f"layers.{i}.{CHILD}.t0_{role}" for i in range(depth) for role in ("down", "up")}
    assert model.state_dict().keys() == {f"layers.{i}.{a}" for i in range(depth) for a in ("weight", "bias")}
    ledger = account(model).components["model"].parameters
    assert sum(ledger[n].residency.anonymous for n in buffers) == factor_bytes  # anonymous, and seen


def test_full_deltas_on_weight_and_bias_apply_at_run_time(tmp_path):
    dim, depth = 32, 2
    model = stack_model(tmp_path, dim, depth)
    gen = torch.Generator().manual_seed(3)
    changes = {f"layers.{i}": {"diff": torch.randn(dim, dim, generator=gen) * 0.01,
                               "diff_b": torch.randn(dim, generator=gen) * 0.01} for i in range(depth)}
    adapters = [(write_adapter(tmp_path / "full.safetensors", "comfyui", changes), 0.7)]
    x = torch.randn(4, dim)
    targets, _ = plan_targets(model, adapters)
    apply_runtime(targets)
    reference = fresh_merge(tmp_path / "ref", adapters, dim, depth, torch.float32)(x)
    assert torch.allclose(model(x), reference, rtol=1e-5, atol=1e-6)


def test_a_target_that_is_not_a_linear_is_refused_naming_it_and_nothing_is_hooked(tmp_path):
    model = mapped_model(tmp_path)  # TinyDiT: a conv patch embedding beside its Linears
    change = lora_change(64, 4, 4, 0, conv=(2, 2))
    linear = lora_change(64, 64, 4, 1)
    changes = {"blocks.0.attn.to_q": linear, "patch_embed": change}
    path = write_adapter(tmp_path / "conv.safetensors", "comfyui", changes)
    targets, _ = plan_targets(model, [path])
    with pytest.raises(ValueError, match=r"'patch_embed.weight' belongs to a Conv2d, not an nn.Linear"):
        apply_runtime(targets)
    assert not any(CHILD in n for n, _ in model.named_modules())
