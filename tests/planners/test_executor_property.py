"""A property of planners.execute: for any sequence of passes, each running any list of blocks
(skips, repeats, any order, empty), with weights replaced before or during a pass (a new tensor,
an in-place write through ``.data``, the mapped original put back), the outputs equal those of
the same script on a second copy of the model without the executor, bit for bit, on the host
path and on the device path's CPU twin."""

from __future__ import annotations


import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from planners.executor import execute  # noqa: E402
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit  # noqa: E402

from .conftest import EXECUTOR_PATHS, synthetic_plan  # noqa: E402

LAYERS, D = 8, 128  # blocks of 64 KiB (fp32)
PATHS = {**EXECUTOR_PATHS, "host-worker": {"read_ahead": "read"}}

block = st.integers(0, LAYERS - 1)
change = st.one_of(
    st.none(),
    st.tuples(st.just("new"), block, st.sampled_from([0.5, 2.0])),  # a new tensor (a fuse, a switch)
    st.tuples(st.just("in_place"), block, st.sampled_from([1e-3, -1e-3])),  # peft's merge: .data written
    st.tuples(st.just("original"), block, st.just(0)),  # back to the mapped checkpoint tensor (an unmerge)
)
step = st.tuples(st.lists(block, max_size=12), change, st.one_of(st.none(), st.tuples(block, block)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_dit(tmp_path_factory.mktemp("property") / "dit.safetensors", LAYERS, D, torch.float32)


@pytest.fixture(scope="module")
def plan(checkpoint):
    return synthetic_plan(checkpoint, 256 * 1024)


def _apply(model, originals, change) -> None:
    if change is None:
        return
    kind, index, value = change
    proj = model.blocks[index].proj
    if kind == "new":
        proj.weight = torch.nn.Parameter(proj.weight.detach() * value, requires_grad=False)
    elif kind == "original":
        proj.weight = originals[index]
    else:
        if proj.weight is originals[index]:  # a mapped weight is read-only: copy it first, as a merge does
            proj.weight = torch.nn.Parameter(proj.weight.detach().clone(), requires_grad=False)
        proj.weight.data += value


def _script(model, steps, settle=lambda: None):
    """``settle``: the executor's reads and copies end before each change (it must be caught, not raced)."""
    originals = [b.proj.weight for b in model.blocks]
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(11))
    outs = []
    with torch.no_grad():
        for order, before, during in steps:
            settle()
            _apply(model, originals, before)
            hook = None
            if during is not None:  # when block ``at`` runs, block ``target`` gets a new weight
                at, target = during
                hook = model.blocks[at].register_forward_pre_hook(
                    lambda m, a, t=target: _apply(model, originals, ("new", t, 0.5)))
            outs.append(model(x, order=order))
            if hook is not None:
                hook.remove()
    return outs


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=4))
def test_any_script_of_orders_and_replacements_gives_the_outputs_of_the_model_alone(checkpoint, plan, path, steps):
    torch.set_num_threads(1)
    expected = _script(load_synthetic_dit(checkpoint), steps)
    model = load_synthetic_dit(checkpoint)
    with execute(plan, {"dit": model}, prefetch=2, **PATHS[path]) as run:
        got = _script(model, steps, run.settle)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
