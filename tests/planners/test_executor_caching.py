"""diffusers' own step caches under planners.execute: a tiny Flux pipeline with a first-block cache,
pyramid attention broadcast or TaylorSeer (hooks that skip or replay blocks on most steps), and a
tiny Wan pipeline with CFG and a first-block cache, give under the executor the outputs of the same
cache without it, bit for bit, on the host path and the device path's twin. And the offload hooks
of diffusers and accelerate are refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", reason="the caching tests run the real diffusers")

from diffusers.hooks import (  # noqa: E402
    FirstBlockCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
    apply_group_offloading,
    apply_taylorseer_cache,
)

from planners.executor import execute  # noqa: E402
from planners.offload_hooks import offload_hooks, offload_warnings  # noqa: E402
from tests.planners.conftest import EXECUTOR_PATHS  # noqa: E402
from tests.planners.tiny_pipelines import (  # noqa: E402
    flux_generate,
    flux_pipe,
    generate_under_executor,
    layer_plan,
    wan_generate,
    wan_pipe,
    wan_plan,
)

CACHES = {
    "first-block": lambda: FirstBlockCacheConfig(threshold=0.5),
    "pyramid-attention": lambda: PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: 500),
    "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
}
PATHS = EXECUTOR_PATHS
pytestmark = pytest.mark.usefixtures("one_thread")


def _pipe(folder, cache: str | None):
    pipe = flux_pipe(folder)
    if cache == "taylorseer":
        apply_taylorseer_cache(pipe.transformer, CACHES[cache]())
    elif cache is not None:
        pipe.transformer.enable_cache(CACHES[cache]())
    return pipe


@pytest.fixture(scope="module")
def uncached(flux_folder):
    return flux_generate(_pipe(flux_folder, None))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache", CACHES)
def test_a_step_cache_under_the_executor_gives_the_cached_outputs(flux_folder, uncached, cache, path):
    expected = flux_generate(_pipe(flux_folder, cache))
    assert not torch.equal(expected, uncached)  # the cache did skip or replay something
    pipe = _pipe(flux_folder, cache)
    got, stats = generate_under_executor(pipe, layer_plan(flux_folder, pipe.transformer), flux_generate, path)
    assert torch.equal(got, expected)
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == 6


def test_offload_hooks_are_refused_by_name_and_group_offloading_is_warned_about(flux_folder):
    folder = flux_folder
    accelerate = pytest.importorskip("accelerate")
    pipe = _pipe(folder, "first-block")
    plan = layer_plan(folder, pipe.transformer)
    assert offload_hooks(pipe.transformer) == [] and offload_warnings({"dit": pipe.transformer}) == []
    grouped = _pipe(folder, None).transformer
    apply_group_offloading(grouped, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    with pytest.raises(ValueError, match="diffusers' group_offloading.*enable_group_offload"):
        execute(plan, {"dit": grouped}).__enter__()
    assert sum(len(m._forward_pre_hooks) for m in grouped.modules()) == 0
    (warning,) = offload_warnings({"dit": grouped})
    assert warning.startswith("dit carries diffusers' group offloading") and "anonymous" in warning
    assert warning in layer_plan(folder, grouped).warnings  # the plan a server starts with says it
    offloaded = accelerate.cpu_offload(_pipe(folder, None).transformer, execution_device="cpu")
    with pytest.raises(ValueError, match="accelerate's .*remove_all_hooks"):
        execute(plan, {"dit": offloaded}).__enter__()


def _wan(folder, cache: bool):
    pipe = wan_pipe(folder)
    if cache:
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    return pipe


@pytest.mark.parametrize("path", PATHS)
def test_a_wan_pipeline_with_cfg_and_a_first_block_cache_under_the_executor(wan_folder, path):
    folder = wan_folder
    expected = wan_generate(_wan(folder, True))
    assert not torch.equal(expected, wan_generate(_wan(folder, False)))
    pipe = _wan(folder, True)
    got, stats = generate_under_executor(pipe, wan_plan(folder, pipe.transformer), wan_generate, path)
    assert torch.equal(got, expected)
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == 12  # 6 steps, two passes each
