"""Weights replaced under planners.execute by the real callers: peft's adapters injected, switched
(``set_adapter``), rescaled, merged (safe: a new tensor) and unmerged (in place through ``.data``)
between passes, and ``hostmem.remap`` turning copied weights back into mappings. Each run equals,
bit for bit, the same steps on a second copy of the model without the executor, on the host path
and on the device path's CPU twin."""

from __future__ import annotations

import os

import pytest
import torch

from hostmem.procfs import read_status
from planners.executor import execute
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit
from planners.executor.trial import synthetic_config
from planners.startup import plan_loaded

from .conftest import EXECUTOR_PATHS, MiB

LAYERS, D = 8, 256
FULL = list(range(LAYERS))
PATHS = EXECUTOR_PATHS
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_dit(tmp_path_factory.mktemp("replace") / "dit.safetensors", LAYERS, D, torch.float32)


def _plan(checkpoint, model):
    reserve = read_status().rss_anon + 256 * MiB
    config = synthetic_config(os.fspath(checkpoint), reserve + MiB, reserve, 0, 3)
    return plan_loaded(config, {"dit": model}, quiet=True)


def _x():
    return torch.randn(3, 64, generator=torch.Generator().manual_seed(5))


def _lora_layers(model):
    from peft.tuners.lora import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def _peft_step(model, i):
    from peft import LoraConfig, inject_adapter_in_model

    if i == 1:
        for name, seed in (("a", 1), ("b", 2)):
            torch.manual_seed(seed)
            inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["proj"], init_lora_weights=False),
                                    model, adapter_name=name)
        for layer in _lora_layers(model):
            layer.set_adapter("a")
    elif i == 2:
        for layer in _lora_layers(model):
            layer.set_adapter("b")  # a switch: other factors, the same modules
    elif i == 3:
        for layer in _lora_layers(model):
            layer.set_scale("b", 0.5)
    elif i == 4:
        for layer in _lora_layers(model):
            layer.merge(safe_merge=True)  # the base weight becomes a new (anonymous) tensor
    elif i == 5:
        for layer in _lora_layers(model):
            layer.unmerge()  # in place: weight.data -= delta; no address or version changes


def _passes(model, step, orders):
    outs = []
    with torch.no_grad():
        for i, order in enumerate(orders):
            step(model, i)
            outs.append(model(_x(), order=order))
    return outs


@pytest.mark.parametrize("path", PATHS)
def test_peft_adapters_injected_switched_merged_and_unmerged_between_passes(checkpoint, path):
    pytest.importorskip("peft")
    orders = [FULL, FULL, FULL[::-1], [0, 1, 2], FULL, FULL, FULL]
    expected = _passes(load_synthetic_dit(checkpoint), _peft_step, orders)
    model = load_synthetic_dit(checkpoint)
    with execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, **PATHS[path]) as run:
        got = _passes(model, lambda m, i: (run.settle(), _peft_step(m, i)), orders)  # no race: caught
        stats = run.stats()
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"pass {i}"
    assert len({tuple(o.flatten()[:4].tolist()) for o in expected}) > 3  # the steps did change the outputs
    assert stats.roles["dit"]["released"] > 0
    assert stats.passes[-1].late_layers == 0  # layers that grew (adapters) are read ahead again once unchanged


def _copied(model):
    """Blocks 2..5 copied into anonymous memory, as a loader that casts or merges leaves them."""
    for i in range(2, 6):
        proj = model.blocks[i].proj
        proj.weight = torch.nn.Parameter(proj.weight.detach().clone(), requires_grad=False)
    return model


@pytest.mark.parametrize("path", PATHS)
def test_remap_between_passes_points_layers_at_the_mapping(checkpoint, path):
    import hostmem

    expected = _passes(_copied(load_synthetic_dit(checkpoint)), lambda m, i: None, [FULL] * 3)
    model = _copied(load_synthetic_dit(checkpoint))
    anonymous = model.blocks[3].proj.weight.data_ptr()

    def step(m, i):
        if i == 1:
            report = hostmem.remap(m, files=[os.fspath(checkpoint)])
            # on the twin the two weights outside the layers stand as copies in host memory for
            # the run (on a GPU, the device's, which remap leaves): remap maps them too
            assert report.remapped == {"host": 4, "twin": 6}[path]

    with execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, **PATHS[path]) as run:
        got = _passes(model, step, [FULL] * 3)
        stats = run.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert model.blocks[3].proj.weight.data_ptr() != anonymous  # mapped now, and stays so after exit
    assert stats.passes[-1].released_bytes > stats.passes[0].released_bytes  # the remapped layers are released too


def _replaced_in_inference_mode(model, i):
    """A weight fused into a new tensor under ``torch.inference_mode()``: an inference tensor,
    which keeps no version counter."""
    if i == 1:
        proj = model.blocks[3].proj
        proj.weight = torch.nn.Parameter(proj.weight * 0.5, requires_grad=False)


@pytest.mark.parametrize("path", PATHS)
def test_passes_and_replacements_under_inference_mode(checkpoint, path):
    """What many servers run under in place of ``no_grad``: tensors made there have no version."""
    def passes(model, step):
        outs = []
        with torch.inference_mode():
            for i, order in enumerate([FULL, FULL[::-1], FULL]):
                step(model, i)
                outs.append(model(_x(), order=order))
        return outs

    expected = passes(load_synthetic_dit(checkpoint), _replaced_in_inference_mode)
    model = load_synthetic_dit(checkpoint)
    with execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, **PATHS[path]) as run:
        got = passes(model, lambda m, i: (run.settle(), _replaced_in_inference_mode(m, i)))
    assert model.blocks[3].proj.weight.is_inference()
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert not torch.equal(expected[0], expected[2])  # the replacement did change the output


@pytest.mark.parametrize("path", PATHS)
def test_weights_outside_the_layers_changed_through_their_parameter_stay_changed_after_exit(checkpoint, path):
    """On the device path the weights outside the layers are placed on the device at entry and
    put back at exit: one changed through its parameter meanwhile (``.data =``, as peft's safe
    merge and ``module.to(dtype)`` do) comes back as it is now, never as it was at entry."""
    def doubled(model):
        model.head.weight.data = model.head.weight.data * 2.0

    reference = load_synthetic_dit(checkpoint)
    doubled(reference)
    model = load_synthetic_dit(checkpoint)
    with execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, **PATHS[path]):
        with torch.no_grad():
            model(_x())
        doubled(model)
    assert torch.equal(model.head.weight, reference.head.weight)
    with torch.no_grad():
        assert torch.equal(model(_x()), reference(_x()))
    with execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, **PATHS[path]):
        model.to(torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    with torch.no_grad():
        assert torch.equal(model(_x().double()), reference.to(torch.float64)(_x().double()))


@pytest.mark.parametrize("path", PATHS)
def test_a_write_into_a_weight_during_the_run_is_the_weight_after_exit(checkpoint, path):
    """peft's ``fuse_lora`` adds its change in place (``weight.data += delta``), which no version
    counter sees. On the device path a weight outside the layers is a copy on the device for the
    run (on the twin too, as on a GPU): the write lands there and comes back at exit, where the
    host's weight of the entry was put back before."""
    def own(model):  # writable weights of their own, as after a private load
        for p in model.parameters():
            p.data = p.data.clone()
        return model

    def written(model):
        with torch.no_grad():
            model.head.weight.data.mul_(2.0)
            model.blocks[2].proj.weight.data.add_(0.5)

    reference = own(load_synthetic_dit(checkpoint))
    written(reference)
    model = own(load_synthetic_dit(checkpoint))
    host = model.head.weight.data_ptr()
    with execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, **PATHS[path]) as run:
        with torch.no_grad():
            model(_x())
        run.settle()
        assert (model.head.weight.data_ptr() != host) == (path == "twin")  # a copy on the device path
        written(model)
        with torch.no_grad():
            inside = model(_x())
    with torch.no_grad():
        expected = reference(_x())
        assert torch.equal(inside, expected)
        assert torch.equal(model(_x()), expected)
    assert torch.equal(model.head.weight, reference.head.weight)
    assert torch.equal(model.blocks[2].proj.weight, reference.blocks[2].proj.weight)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a parameter made on the device needs a GPU")
def test_a_parameter_added_on_the_gpu_during_the_run_is_the_hosts_after_exit(checkpoint):
    """``load_lora_weights`` during a run adds its factors on the device of the weight beside them:
    after exit they come to the host with that weight, so the next forward does not mix devices."""
    model = load_synthetic_dit(checkpoint)
    with torch.no_grad(), execute(_plan(checkpoint, model), {"dit": model}, prefetch=2, device="cuda") as run:
        model(_x().cuda())
        run.settle()
        model.head.register_parameter("added", torch.nn.Parameter(torch.ones(1, device=model.head.weight.device)))
    assert model.head.added.device.type == "cpu" and float(model.head.added) == 1.0
    with torch.no_grad():
        assert torch.equal(model(_x()), load_synthetic_dit(checkpoint)(_x()))
