"""Switching models that share modules: one module serves one combination at a time.

A server that holds two pipelines sharing a text encoder, or that switches a transformer
alone and later its whole pipeline, must never have one call's switch reach another
model's weights, leave a module with both its merged weight and its run-time terms, or
report a switch it did not make."""

from __future__ import annotations

import os

import pytest
import torch

import lora_cache
from lora_cache.placement.runtime_lora import runtime_bytes
from lora_cache.switching.adapter_switch import serving
from tests.lora_cache.test_adapters import lora_change, write_adapter
from tests.lora_cache.switching.test_runtime_lora import stack_model

DIM, DEPTH = 64, 3


def _adapter(path, components: list[str], seed: int) -> str:
    """A rank-4 adapter on every layer of each named component (keys ``component.layers.i``)."""
    changes = {}
    for c, component in enumerate(components):
        for i in range(DEPTH):
            change = lora_change(DIM, DIM, 4, seed * 100 + c * 10 + i)
            changes[".".join(filter(None, (component, "layers", str(i))))] = {"up": change["up"] * 0.1,
                                                                            "down": change["down"]}
    return write_adapter(path, "comfyui", changes, prefix="")


def _models(tmp_path) -> dict[str, torch.nn.Module]:
    return {name: stack_model(os.path.join(tmp_path, name), DIM, DEPTH, seed=seed)
            for seed, name in enumerate(("t1", "t2", "te"))}


def _reference(tmp_path, names: dict[str, str], adapters) -> dict[str, dict[str, torch.Tensor]]:
    """The same components loaded again and merged in place: what the switched ones must hold."""
    fresh = {component: stack_model(os.path.join(tmp_path, "ref", component), DIM, DEPTH,
                                    seed=("t1", "t2", "te").index(model))
             for component, model in names.items()}
    lora_cache.merge(fresh, adapters, cache_root=None, enabled=False, progress=False)
    return {c: {n: p.detach().clone() for n, p in m.named_parameters()} for c, m in fresh.items()}


def _holds(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def _base(tmp_path, model: str) -> dict[str, torch.Tensor]:
    fresh = stack_model(os.path.join(tmp_path, "base", model), DIM, DEPTH, seed=("t1", "t2", "te").index(model))
    return {n: p.detach().clone() for n, p in fresh.named_parameters()}


def test_a_pipeline_sharing_a_switched_module_is_refused_and_the_other_keeps_its_weights(tmp_path):
    m = _models(tmp_path)
    root = tmp_path / "cache"
    p1, p2 = {"transformer": m["t1"], "text_encoder": m["te"]}, {"transformer": m["t2"], "text_encoder": m["te"]}
    a = _adapter(tmp_path / "a.safetensors", ["transformer", "text_encoder"], 1)
    b = _adapter(tmp_path / "b.safetensors", ["transformer"], 2)
    assert lora_cache.set_adapters(p1, [a], cache_root=root, background=False).mode == "built"
    served = _reference(tmp_path, {"transformer": "t1", "text_encoder": "te"}, [a])

    with pytest.raises(ValueError, match=r"text_encoder is switched together with transformer .*"
                                         r"set_adapters\(pipe\.transformer"):
        lora_cache.set_adapters(p2, [b], cache_root=root)
    assert _holds(m["t1"], served["transformer"]) and _holds(m["te"], served["text_encoder"])
    assert _holds(m["t2"], _base(tmp_path, "t2"))  # untouched, and not reported "unchanged"

    # the module that is not shared switches on its own, and the other pipeline keeps its combination
    switched = lora_cache.set_adapters(m["t2"], [(_adapter(tmp_path / "b2.safetensors", [""], 2), 1.0)],
                                       cache_root=root, background=False)
    assert switched.mode == "built"
    assert _holds(m["t1"], served["transformer"]) and _holds(m["te"], served["text_encoder"])
    assert not _holds(m["t2"], _base(tmp_path, "t2"))

    # once the first pipeline is at the base, the second may take the shared module over
    assert lora_cache.set_adapters(p1, [], cache_root=root).mode == "base"
    lora_cache.set_adapters(m["t2"], [], cache_root=root)
    assert lora_cache.set_adapters(p2, [b], cache_root=root, background=False).mode in ("built", "cached")
    assert _holds(m["t2"], _reference(tmp_path, {"transformer": "t2"}, [b])["transformer"])
    assert _holds(m["te"], _base(tmp_path, "te")) and _holds(m["t1"], _base(tmp_path, "t1"))
    with pytest.raises(ValueError, match="text_encoder is switched together with transformer"):
        lora_cache.set_adapters(p1, [a], cache_root=root)


def test_a_transformer_switched_alone_then_its_whole_pipeline_serves_each_adapter_once(tmp_path):
    m = _models(tmp_path)
    root = tmp_path / "cache"
    pipe = {"transformer": m["t1"], "text_encoder": m["te"]}
    alone = _adapter(tmp_path / "alone.safetensors", [""], 3)
    a = _adapter(tmp_path / "a.safetensors", ["transformer", "text_encoder"], 1)
    x = torch.randn(2, DIM)

    assert lora_cache.set_adapters(m["t1"], [alone], cache_root=root).mode == "runtime"
    m["t1"](x)
    assert lora_cache.swap_ready(m["t1"], wait=True, timeout=60)
    first = lora_cache.set_adapters(pipe, [a], cache_root=root)
    assert first.mode == "runtime"
    for model in pipe.values():
        model(x)
    assert lora_cache.swap_ready(pipe, wait=True, timeout=60)
    m["te"](x)  # the swap point of the text encoder too
    served = _reference(tmp_path, {"transformer": "t1", "text_encoder": "te"}, [a])
    assert serving(pipe) == "merged" and runtime_bytes(pipe) == 0
    assert _holds(m["t1"], served["transformer"]) and _holds(m["te"], served["text_encoder"])
    ref = stack_model(os.path.join(tmp_path, "out"), DIM, DEPTH, seed=2)
    for name, weight in served["text_encoder"].items():  # (its own are read-only mapped views)
        owner, _, attr = name.rpartition(".")
        ref.get_submodule(owner)._parameters[attr] = torch.nn.Parameter(weight, requires_grad=False)
    assert torch.equal(m["te"](x), ref(x))  # the merged weight alone: no run-time terms on top

    # asked of the transformer alone, the whole pipeline's state answers, and the same
    # combination asked again is unchanged
    assert serving(m["t1"]) == "merged"
    assert lora_cache.set_adapters(pipe, [a], cache_root=root).mode == "unchanged"
    assert lora_cache.set_adapters(pipe, [], cache_root=root).mode == "base"
    assert _holds(m["t1"], _base(tmp_path, "t1")) and _holds(m["te"], _base(tmp_path, "te"))
    assert runtime_bytes(pipe) == 0
