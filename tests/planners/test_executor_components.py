"""Two components under one executor: passes of each interleaved, and one component held
as a child of the other. Each run equals, bit for bit, the same calls on the models without
the executor, on the host path and on the device path's CPU twin."""

from __future__ import annotations

import os

import pytest
import torch

from hostmem.procfs import read_status
from planners.executor import execute
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit
from planners.startup import plan_loaded

from .conftest import MiB
from .test_executor_orders import D, FULL, PATHS, ROOM, _same, _x, checkpoint  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def _two(tmp_path, checkpoint):
    other = write_synthetic_dit(tmp_path / "te.safetensors", 4, D, torch.float32, seed=3)
    reserve = read_status().rss_anon + 256 * MiB
    from planners.config import parse_config

    text = (
        "deployment: two\n"
        f"host: {{limit: {reserve + ROOM + MiB // 2}B, reserve: {reserve}B, max_pinned: 0B}}\n"
        "workload: {steps: 2}\n"
        "components:\n"
        f"  dit: {{path: {checkpoint}, layers: \"blocks.{{i}}.\", offload: layerwise}}\n"
        f"  te: {{path: {other}, layers: \"blocks.{{i}}.\", offload: full}}\n"
    )
    config = parse_config(text, os.fspath(tmp_path / "two.yaml"), environ={})
    return other, config


@pytest.mark.parametrize("path", PATHS)
def test_two_components_interleaved(tmp_path, checkpoint, path):
    other, config = _two(tmp_path, checkpoint)

    def script(dit, te):
        with torch.no_grad():
            outs = [te(_x(), order=[0, 1, 2, 3]), dit(_x(), order=FULL[:5])]
            outs += [te(_x(), order=[3, 2]), dit(_x(), order=FULL[::-1]), te(_x()), dit(_x(), order=[0, 15])]
        return outs

    expected = script(load_synthetic_dit(checkpoint), load_synthetic_dit(other))
    dit, te = load_synthetic_dit(checkpoint), load_synthetic_dit(other)
    plan = plan_loaded(config, {"dit": dit, "te": te}, quiet=True)
    with execute(plan, {"dit": dit, "te": te}, prefetch=2, **PATHS[path]) as run:
        got = script(dit, te)
        stats = run.stats()
    _same(got, expected)
    assert [p.component for p in stats.passes] == ["te", "dit"] * 3


@pytest.mark.parametrize("path", PATHS)
def test_a_component_nested_in_another_streams_its_own_layers(tmp_path, checkpoint, path):
    """A text encoder held as a child of the DiT (outside the DiT's layers): the DiT's
    placement leaves it to its own plan, so its streamed layers are never placed on the
    device whole (on a GPU, a copy of each beyond the plan's device memory), and every
    output equals the model's without the executor."""
    other, config = _two(tmp_path, checkpoint)

    def script(dit, te):
        with torch.no_grad():
            return [te(_x()), dit(_x(), order=FULL[:5]), te(_x(), order=[3, 2]), dit(_x())]

    def nested():
        dit, te = load_synthetic_dit(checkpoint), load_synthetic_dit(other)
        dit.add_module("text_encoder", te)
        return dit, te

    expected = script(*nested())
    dit, te = load_synthetic_dit(checkpoint), load_synthetic_dit(other)
    plan = plan_loaded(config, {"dit": dit, "te": te}, quiet=True)
    dit.add_module("text_encoder", te)
    streamed = {n: p for n, p in te.named_parameters() if n.startswith("blocks.")}
    with execute(plan, {"dit": dit, "te": te}, prefetch=2, **PATHS[path]):
        assert all(p is streamed[n] for n, p in te.named_parameters() if n in streamed)
        got = script(dit, te)
    _same(got, expected)
