"""cache-dit under planners.execute, as servers run it: DBCache computes the first and last
block and, on most steps, replays the residual of the middle ones instead of running them;
DBPrune skips a different subset of blocks at each step. A tiny Flux pipeline under either and
a tiny Wan pipeline with CFG under DBCache give under the executor the outputs of the same cache
without it, bit for bit, on the host path and the device path's twin; cache-dit's own record
says it skipped. And cache-dit's layer-wise offload, which moves weights itself, is refused by
name."""

from __future__ import annotations

import contextlib

import pytest
import torch

cache_dit = pytest.importorskip("cache_dit", reason="the cache-dit tests run the real cache-dit")

from planners.executor import execute  # noqa: E402
from planners.offload_hooks import offload_hooks, offload_warnings  # noqa: E402
from tests.planners.conftest import EXECUTOR_PATHS  # noqa: E402
from tests.planners.tiny_pipelines import (  # noqa: E402
    STEPS,
    flux_generate,
    flux_pipe,
    generate_under_executor,
    layer_plan,
    wan_generate,
    wan_pipe,
    wan_plan,
)

PATHS = EXECUTOR_PATHS
# After one warm-up step: DBCache computes the first and the last block and replays the middle
# ones once the first block's residual changed by less than the threshold; DBPrune computes the
# first and skips each later block whose own residual changed by less than it.
CACHES = {
    "dbcache": lambda: cache_dit.DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=1, max_warmup_steps=1,
                                               residual_diff_threshold=0.8, num_inference_steps=STEPS),
    "dbprune": lambda: cache_dit.DBPruneConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1,
                                               residual_diff_threshold=0.3, num_inference_steps=STEPS),
}
pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def cached(pipe, cache: str):
    """cache-dit's ``cache`` on ``pipe``. cache-dit wraps the pipeline's class ``__call__``; it
    is undone on leaving, so that no other test's pipeline runs through it."""
    cache_dit.enable_cache(pipe, cache_config=CACHES[cache]())
    try:
        yield pipe
    finally:
        cache_dit.disable_cache(pipe)


def _skipped(pipe) -> tuple[int, int]:
    """Steps (and CFG steps) of the last call whose middle blocks cache-dit replayed, by its own record."""
    (stats, *_) = cache_dit.summary(pipe, logging=False)
    return len(stats.cached_steps), len(stats.cfg_cached_steps)


def _cached_and_executed(pipe, cache, generate, plan_of, path):
    """The outputs of ``pipe`` under ``cache`` without the executor and under it, each with how
    many steps cache-dit skipped, and the executor's stats."""
    with cached(pipe, cache):
        expected = generate(pipe)
        skipped = _skipped(pipe)
        got, stats = generate_under_executor(pipe, plan_of(pipe.transformer), generate, path)
        return expected, skipped, got, _skipped(pipe), stats


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache", CACHES)
def test_a_flux_pipeline_under_cache_dit_gives_its_outputs_under_the_executor(flux_folder, cache, path):
    uncached = flux_generate(flux_pipe(flux_folder))
    expected, skipped, got, skipped_under, stats = _cached_and_executed(
        flux_pipe(flux_folder), cache, flux_generate, lambda transformer: layer_plan(flux_folder, transformer), path)
    assert skipped[0] >= 2 and skipped_under == skipped  # the middle blocks were skipped on some steps
    assert not torch.equal(expected, uncached)
    assert torch.equal(got, expected)
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == STEPS


@pytest.mark.parametrize("path", PATHS)
def test_a_wan_pipeline_with_cfg_under_dbcache_gives_its_outputs_under_the_executor(wan_folder, path):
    uncached = wan_generate(wan_pipe(wan_folder))
    expected, skipped, got, skipped_under, stats = _cached_and_executed(
        wan_pipe(wan_folder), "dbcache", wan_generate, lambda transformer: wan_plan(wan_folder, transformer), path)
    assert min(skipped) >= 2 and skipped_under == skipped  # both the conditional and the CFG passes skipped
    assert not torch.equal(expected, uncached)
    assert torch.equal(got, expected)
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == 2 * STEPS


def _layerwise_offload(pipe):
    """cache-dit's layer-wise offload of the pipeline's transformer, as a server with a GPU calls
    it. Without one its pinned host mirror cannot be made: the same call, with the same hooks and
    handle, then offloads to the meta device and leaves the weights where they are until a pass."""
    if torch.cuda.is_available():
        return cache_dit.layerwise_cpu_offload(pipe, onload_device="cuda")
    return cache_dit.layerwise_offload(pipe, onload_device="cpu", offload_device="meta", eager_offload=False)


def test_cache_dits_layerwise_offload_is_refused_by_name_and_warned_about(flux_folder):
    plan = layer_plan(flux_folder, flux_pipe(flux_folder).transformer)
    pipe = flux_pipe(flux_folder)
    _layerwise_offload(pipe)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pipe.transformer.modules())
    assert hooks > 0 and offload_hooks(pipe.transformer) == ["(the module itself): cache-dit's layerwise_offload"]
    with pytest.raises(ValueError, match="cache-dit's layerwise_offload.*cache_dit.remove_layerwise_offload"):
        execute(plan, {"dit": pipe.transformer}).__enter__()
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in pipe.transformer.modules()) == hooks
    (warning,) = offload_warnings({"dit": pipe.transformer})
    assert warning.startswith("dit carries cache-dit's layer-wise offload") and "anonymous" in warning
    assert warning in layer_plan(flux_folder, pipe.transformer).warnings
    assert cache_dit.remove_layerwise_offload(pipe, offload=False) == 1  # as the refusal says
    assert offload_hooks(pipe.transformer) == [] and offload_warnings({"dit": pipe.transformer}) == []
