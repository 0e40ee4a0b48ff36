"""planners.execute in any order a server runs the layers: skips (step caching), subsets, reverse,
repeats, partial passes, CFG, layers that share a tensor, and weights
replaced between and during passes. Each run equals, bit for bit, the same order and the same
replacements on a second copy of the model without the executor, on the host path and on the
device path's CPU twin, with a plan whose page cache is too small to keep every layer."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from hostmem.procfs import PAGE_SIZE, read_status
from hostmem.residency import classify_range
from planners.executor import execute, plan_roles
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit
from planners.executor.trial import synthetic_config
from planners.startup import plan_loaded

from .conftest import EXECUTOR_PATHS, MiB, synthetic_plan

LAYERS, D = 16, 256  # blocks of 256 KiB (fp32)
ROOM = 2 * MiB  # page cache for half the layers: the rest are released after use
FULL = list(range(LAYERS))
PATHS = {**EXECUTOR_PATHS, "host-worker": {"read_ahead": "read"}}
ORDERS = {
    "skip": [FULL, [0, 1, 14, 15], [0, 1, 14, 15], FULL],
    "first-block-cache": [FULL, [0], [0], FULL, [0]],
    "subset": [sorted(random.Random(s).sample(FULL, 7)) for s in range(3)],
    "reverse": [FULL[::-1]] * 3,
    "repeat": [[0, 1, 2, 2, 2, 3, *FULL[4:], 15]] * 2,
    "partial": [FULL[:8], FULL, FULL[:8], FULL[:3]],
    "cfg": [FULL, FULL],
    "shuffled": [random.Random(s).sample(FULL, LAYERS) for s in range(3)],
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_dit(tmp_path_factory.mktemp("orders") / "dit.safetensors", LAYERS, D, torch.float32)


@pytest.fixture(scope="module")
def plan(checkpoint):
    made = synthetic_plan(checkpoint, ROOM)
    assert not made.pins.plans["dit"].page_cache_fits
    return made


def _x():
    return torch.randn(3, 64, generator=torch.Generator().manual_seed(7))  # 3 rows: not a 1-row GEMV


def _run(model, passes, between=None):
    outs = []
    with torch.no_grad():
        for i, order in enumerate(passes):
            if between is not None:
                between(model, i)
            outs.append(model(_x(), order=order))
    return outs


def _under(plan, model, options, passes, between=None, components=None, own_hooks=0):
    with execute(plan, components or {"dit": model}, prefetch=2, **options) as run:
        # the executor's reads and copies ended: a write below cannot race them, it must be caught
        settled = None if between is None else (lambda m, i: (run.settle(), between(m, i)))
        outs = _run(model, passes, settled)
        stats = run.stats()
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == own_hooks
    return outs, stats


def _same(got, expected):
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"pass {i}: largest difference {(a - b).abs().max()}"


@pytest.mark.parametrize("path", PATHS)
def test_any_order_gives_the_outputs_of_the_model_alone(checkpoint, plan, path):
    """Every order of ORDERS, one after another under one executor (each switch is a change of order)."""
    passes = [order for name in ORDERS for order in ORDERS[name]]
    expected = _run(load_synthetic_dit(checkpoint), passes)
    got, stats = _under(plan, load_synthetic_dit(checkpoint), PATHS[path], passes)
    _same(got, expected)
    assert stats.roles["dit"]["released"] > 0 and sum(p.released_bytes for p in stats.passes) > 0


@pytest.mark.parametrize("path", ["host-worker", "twin"])
def test_the_read_ahead_learns_the_order_the_model_runs(checkpoint, plan, path):
    """Reverse passes: the plan's order predicts none of the layers; from the second pass on, the
    order seen does, so no layer waits for a read or copy started at its own forward."""
    passes = [FULL[::-1]] * 3
    _, stats = _under(plan, load_synthetic_dit(checkpoint), PATHS[path], passes)
    late = [p.late_layers for p in stats.passes]
    assert late[0] >= LAYERS // 2 and late[1:] == [0, 0], late


def _replace(model, index, scale):
    """A LoRA switch as diffusers' fuse does it: the module gets a new (anonymous) weight."""
    old = model.blocks[index].proj.weight
    model.blocks[index].proj.weight = torch.nn.Parameter(old.detach() * scale, requires_grad=False)


def _between(model, i):
    if i == 1:
        _replace(model, 0, 0.5)  # the first layer: read ahead at the end of the pass before
        _replace(model, 9, 1.5)
    if i == 2:
        model.blocks[0].proj.weight.data += 1e-3  # peft's merge: in place through .data, nothing changes but bytes
    if i == 3:
        model.blocks[4].proj.weight = model.blocks[3].proj.weight  # a weight now shared by two layers


@pytest.mark.parametrize("path", PATHS)
def test_weights_replaced_between_passes(checkpoint, plan, path):
    passes = [FULL, FULL, [0, 1, 2], FULL[::-1], FULL]
    expected = _run(load_synthetic_dit(checkpoint), passes, _between)
    got, _ = _under(plan, load_synthetic_dit(checkpoint), PATHS[path], passes, _between)
    _same(got, expected)


def _during(model, i):
    """Hooks that, inside a pass, replace a weight of a layer that is read ahead by then."""
    def swap(module, args, target=model.blocks[7]):
        target.proj.weight = torch.nn.Parameter(target.proj.weight.detach() * 0.25, requires_grad=False)

    if i == 1:
        model._swap = model.blocks[6].register_forward_pre_hook(swap)
    if i == 2:
        model._swap.remove()


@pytest.mark.parametrize("path", PATHS)
def test_a_weight_replaced_during_a_pass(checkpoint, plan, path):
    passes = [FULL, FULL, FULL]
    expected = _run(load_synthetic_dit(checkpoint), passes, _during)
    model = load_synthetic_dit(checkpoint)
    got, _ = _under(plan, model, PATHS[path], passes, _during)
    _same(got, expected)


class _Gated(torch.nn.Module):
    """A block that also reads a table every block shares (a view of block 0's mapped weight)."""

    def __init__(self, block, table):
        super().__init__()
        self.proj = block.proj
        self.register_buffer("table", table, persistent=False)

    def forward(self, x):
        return x + torch.tanh(self.proj(x)) * self.table


def _share(model):
    table = model.blocks[0].proj.weight[1]
    for i in range(1, LAYERS):
        model.blocks[i] = _Gated(model.blocks[i], table)
    return model


@pytest.mark.parametrize("path", PATHS)
def test_layers_that_share_a_tensor_run_and_the_shared_pages_are_not_released(checkpoint, path):
    reserve = read_status().rss_anon + 256 * MiB
    config = synthetic_config(os.fspath(checkpoint), reserve + ROOM, reserve, 0, 3)
    model = _share(load_synthetic_dit(checkpoint))
    shared = plan_loaded(config, {"dit": model}, quiet=True)
    passes = [FULL, FULL[::-1], [0, 5, 6]]
    expected = _run(_share(load_synthetic_dit(checkpoint)), passes)
    table = model.blocks[1].table
    start = table.data_ptr() - table.data_ptr() % PAGE_SIZE
    resident = []

    def after_block_0(module, args, output):
        resident.append(classify_range(start, start + PAGE_SIZE).file_backed)

    def between(model, i):  # registered under the executor: runs after its release
        if i == 0:
            model.blocks[0].register_forward_hook(after_block_0)

    got, stats = _under(shared, model, PATHS[path], passes, between, own_hooks=1)
    _same(got, expected)
    assert "blocks.0" in plan_roles(shared, 2)["dit"].released and stats.roles["dit"]["released"] > 0
    assert resident == [PAGE_SIZE] * 3  # block 0 released, but not the page the others read too


def test_a_forward_that_raises_leaves_the_host_weights_in_place(checkpoint, plan):
    model = load_synthetic_dit(checkpoint)
    weights = [p for p in model.parameters()]
    expected = _run(load_synthetic_dit(checkpoint), [FULL])

    def boom(module, args):
        raise RuntimeError("a forward that fails")

    with execute(plan, {"dit": model}, device="cpu", prefetch=2):
        handle = model.blocks[5].proj.register_forward_pre_hook(boom)
        with pytest.raises(RuntimeError, match="fails"), torch.no_grad():
            model(_x())
        handle.remove()
        got = _run(model, [FULL])
    _same(got, expected)
    assert all(a is b for a, b in zip(model.parameters(), weights))


@pytest.mark.parametrize("path", PATHS)
def test_a_second_executor_on_a_module_another_runs_is_refused(checkpoint, plan, path):
    """Two would hook the same layers, and the second's device copies would stand in for the
    first's: refused while the first runs, the first's passes untouched; fine once it is left."""
    from hostmem.errors import InputError

    expected = _run(load_synthetic_dit(checkpoint), [FULL, FULL])
    model = load_synthetic_dit(checkpoint)
    with execute(plan, {"dit": model}, prefetch=2, **PATHS[path]):
        with pytest.raises(InputError, match=r"'dit': its SyntheticDiT is already run by another executor"):
            with execute(plan, {"dit": model}, prefetch=2, **PATHS[path]):
                pass
        with pytest.raises(InputError, match=r"'dit': its _Block is already run"):  # a part of it, under another name
            with execute(plan, {"dit": model.blocks[3]}, prefetch=2, **PATHS[path]):
                pass
        got = _run(model, [FULL])
    got += _under(plan, model, PATHS[path], [FULL])[0]
    _same(got, expected)


def test_a_checkpoint_let_go_while_running_leaves_nothing_at_exit(checkpoint, plan, tmp_path):
    """Every weight replaced from another file (``load_state_dict(assign=True)``) and the first
    mapping unmapped before exit: advice can no longer be undone there, and every other step
    of the exit still runs (threads ended, descriptors closed)."""
    import gc
    import threading

    from hostmem.safetensors.mapping import load_readonly

    other = write_synthetic_dit(tmp_path / "other.safetensors", LAYERS, D, torch.float32, seed=1)
    expected = _run(load_synthetic_dit(other), [FULL])
    model = load_synthetic_dit(checkpoint)
    with execute(plan, {"dit": model}, prefetch=2, read_ahead="madvise"):
        _run(model, [FULL])
        model.load_state_dict(load_readonly(other), assign=True)
        gc.collect()
        got = _run(model, [FULL])
        gc.collect()
        assert os.fspath(checkpoint) not in open("/proc/self/maps").read()
    _same(got, expected)
    assert not [t for t in threading.enumerate() if t.name.startswith("hostmem-readahead")]
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    assert os.fspath(checkpoint) not in fds


class _ScaledParameter(torch.nn.Parameter):
    """A weight whose class carries what it means (as diffusers' GGUFParameter carries
    ``quant_type``): the forward reads ``scale`` from it, and without it uses the bytes as is."""

    def __new__(cls, data, scale):
        made = torch.Tensor._make_subclass(cls, data, False)
        made.scale = scale
        return made


class _ScaledLinear(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = _ScaledParameter(weight.detach(), 0.5)  # the mapped bytes: a view, no copy

    def forward(self, h):
        return torch.nn.functional.linear(h, self.weight.as_subclass(torch.Tensor)) * getattr(self.weight, "scale", 1.0)


@pytest.mark.parametrize("path", PATHS)
def test_a_parameter_of_a_subclass_keeps_its_class_and_attributes_in_the_forward(checkpoint, plan, path):
    def scaled(model):
        for block in model.blocks:
            block.proj = _ScaledLinear(block.proj.weight)
        return model

    expected = _run(scaled(load_synthetic_dit(checkpoint)), [FULL, FULL[::-1]])
    model = scaled(load_synthetic_dit(checkpoint))
    seen = []
    hook = model.blocks[5].proj.register_forward_pre_hook(lambda m, a: seen.append(type(m.weight)))
    got, _ = _under(plan, model, PATHS[path], [FULL, FULL[::-1]], own_hooks=1)
    hook.remove()
    _same(got, expected)
    assert seen == [_ScaledParameter] * 2 and type(model.blocks[5].proj.weight) is _ScaledParameter


class _Counting(torch.nn.Module):
    """A block whose forward updates its own state in place (a step counter; running
    statistics do the same), kept in anonymous memory as a model keeps its buffers."""

    def __init__(self, block):
        super().__init__()
        self.proj = block.proj
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, h):
        self.calls += 1
        return h + torch.tanh(self.proj(h)) * self.calls


@pytest.mark.parametrize("path", PATHS)
def test_what_a_forward_writes_into_its_own_buffers_stays_written(checkpoint, path):
    """On the device path a layer computes from copies of its tensors: a write there goes
    back to the host tensor, as it would without the executor."""
    def counting(model):
        for i in range(LAYERS):
            model.blocks[i] = _Counting(model.blocks[i])
        return model

    passes = [FULL, FULL[::-1], [0, 1, 2]]
    expected_model = counting(load_synthetic_dit(checkpoint))
    expected = _run(expected_model, passes)
    model = counting(load_synthetic_dit(checkpoint))
    got, _ = _under(synthetic_plan(checkpoint, ROOM, model), model, PATHS[path], passes)
    _same(got, expected)
    assert [float(b.calls) for b in model.blocks] == [float(b.calls) for b in expected_model.blocks]
    assert float(model.blocks[0].calls) == 3 and float(model.blocks[5].calls) == 2


class _Waiting(torch.nn.Module):
    """Block 3: in thread ``a`` it takes its weight, then waits (at most a second) for the
    other thread to reach block 4 before it computes with it."""

    def __init__(self, block, reached):
        super().__init__()
        self.proj, self.reached = block.proj, reached

    def forward(self, h):
        import threading

        weight = self.proj.weight
        if threading.current_thread().name == "a":
            self.reached.wait(1.0)
        return h + torch.tanh(torch.nn.functional.linear(h, weight))


@pytest.mark.parametrize("path", PATHS)
def test_passes_from_two_threads_each_compute_with_their_own_layers(checkpoint, plan, path):
    """A server's two requests at once on one model: on the device path a layer's copy is
    attached to the module both threads run, so their passes take turns; on the host path
    they run as they would without the executor."""
    import threading

    inputs = {"a": torch.randn(3, 64, generator=torch.Generator().manual_seed(1)),
              "b": torch.randn(3, 64, generator=torch.Generator().manual_seed(2))}
    reference = load_synthetic_dit(checkpoint)
    with torch.no_grad():
        expected = {k: reference(x) for k, x in inputs.items()}
    model = load_synthetic_dit(checkpoint)
    reached = threading.Event()
    model.blocks[3] = _Waiting(model.blocks[3], reached)
    hook = model.blocks[4].register_forward_pre_hook(
        lambda m, a: reached.set() if threading.current_thread().name == "b" else None)
    got = {}

    def run(name):
        with torch.no_grad():
            got[name] = model(inputs[name])

    with execute(plan, {"dit": model}, prefetch=2, **PATHS[path]):
        first = threading.Thread(target=run, args=("a",), name="a")
        first.start()
        time.sleep(0.1)  # a is in block 3 by now (or soon): b starts its pass beside it
        second = threading.Thread(target=run, args=("b",), name="b")
        second.start()
        first.join(30)
        second.join(30)
    hook.remove()
    assert set(got) == {"a", "b"}
    for name in inputs:
        assert torch.equal(got[name], expected[name]), name


def test_many_passes_from_two_threads_at_once_on_the_host_path_keep_their_bookkeeping_whole(checkpoint, plan):
    """Two threads running passes side by side, many times, with nothing making them take
    turns: one thread's read-ahead, drop and release never pull a layer from under the
    other's hooks (a read-ahead dropped by both raised KeyError in one thread's forward)."""
    import threading

    inputs = [torch.randn(3, 64, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    reference = load_synthetic_dit(checkpoint)
    with torch.no_grad():
        expected = [reference(x) for x in inputs]
    model = load_synthetic_dit(checkpoint)
    errors, outputs = [], {0: [], 1: []}

    def run(i):
        try:
            with torch.no_grad():
                for _ in range(40):
                    outputs[i].append(model(inputs[i]))
        except Exception as exc:  # noqa: BLE001 - what a server's request would die of
            errors.append(exc)

    with execute(plan, {"dit": model}, prefetch=3):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert errors == []
    assert all(torch.equal(out, expected[i]) for i in range(2) for out in outputs[i])


def test_a_run_kept_after_exit_keeps_no_checkpoint_the_model_let_go(checkpoint, plan, tmp_path):
    """A server that keeps ``run`` to read its stats: once the model's weights come from another
    file, the first checkpoint is unmapped, as without the executor."""
    import gc

    from hostmem.safetensors.mapping import load_readonly

    other = write_synthetic_dit(tmp_path / "other.safetensors", LAYERS, D, torch.float32, seed=1)
    model = load_synthetic_dit(checkpoint)
    with execute(plan, {"dit": model}, prefetch=2, read_ahead="madvise") as run:
        _run(model, [FULL])
    model.load_state_dict(load_readonly(other), assign=True)
    gc.collect()
    assert os.fspath(checkpoint) not in open("/proc/self/maps").read()
    assert len(run.stats().passes) == 1
