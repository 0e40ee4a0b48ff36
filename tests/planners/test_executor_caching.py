"""diffusers' own step caches under planners.execute: a tiny Flux pipeline with a first-block cache,
pyramid attention broadcast or TaylorSeer (hooks that skip or replay blocks on most steps), and a
tiny Wan pipeline with CFG and a first-block cache, give under the executor the outputs of the same
cache without it, bit for bit, on the host path and the device path's twin. And the offload hooks
of diffusers and accelerate are refused by name."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the caching tests run the real diffusers")

from diffusers import (  # noqa: E402
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.hooks import (  # noqa: E402
    FirstBlockCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
    apply_group_offloading,
    apply_taylorseer_cache,
)

from hostmem.procfs import read_status  # noqa: E402
from planners.config import parse_config  # noqa: E402
from planners.executor import execute  # noqa: E402
from planners.offload_hooks import offload_hooks, offload_warnings  # noqa: E402
from planners.startup import plan_loaded  # noqa: E402
from tests.planners.conftest import EXECUTOR_PATHS  # noqa: E402

MiB = 1 << 20
CACHES = {
    "first-block": lambda: FirstBlockCacheConfig(threshold=0.5),
    "pyramid-attention": lambda: PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: 500),
    "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
}
PATHS = EXECUTOR_PATHS
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("caching")
    torch.manual_seed(0)
    FluxTransformer2DModel(  # 6 blocks of about 2.3 MiB in fp32
        patch_size=1, in_channels=4, num_layers=6, num_single_layers=1, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=[8, 12, 12],
    ).save_pretrained(root / "transformer")
    return root


def _pipe(folder, cache: str | None):
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer").eval()
    if cache == "taylorseer":
        apply_taylorseer_cache(transformer, CACHES[cache]())
    elif cache is not None:
        transformer.enable_cache(CACHES[cache]())
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)


def _generate(pipe):
    embeds = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    pooled = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=6, height=32, width=32,
                    output_type="latent", generator=torch.Generator().manual_seed(3)).images


def _plan(folder, transformer, sub="transformer", layers="transformer_blocks.{i}.", room=2 * MiB):
    reserve = read_status().rss_anon + 256 * MiB
    text = (
        "deployment: caching\n"
        f"host: {{limit: {reserve + room}B, reserve: {reserve}B, max_pinned: 0B}}\n"
        "workload: {steps: 6}\n"
        "components:\n"
        f"  dit: {{path: {folder / sub}, layers: \"{layers}\", offload: layerwise}}\n"
    )
    config = parse_config(text, os.fspath(folder / "deploy.yaml"), environ={})
    return plan_loaded(config, {"dit": transformer}, quiet=True)


@pytest.fixture(scope="module")
def uncached(folder):
    return _generate(_pipe(folder, None))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cache", CACHES)
def test_a_step_cache_under_the_executor_gives_the_cached_outputs(folder, uncached, cache, path):
    expected = _generate(_pipe(folder, cache))
    assert not torch.equal(expected, uncached)  # the cache did skip or replay something
    pipe = _pipe(folder, cache)
    plan = _plan(folder, pipe.transformer)
    with execute(plan, {"dit": pipe.transformer}, prefetch=2, **PATHS[path]) as run:
        got = _generate(pipe)
        stats = run.stats()
    assert torch.equal(got, expected)
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == 6


def test_offload_hooks_are_refused_by_name_and_group_offloading_is_warned_about(folder):
    accelerate = pytest.importorskip("accelerate")
    pipe = _pipe(folder, "first-block")
    plan = _plan(folder, pipe.transformer)
    assert offload_hooks(pipe.transformer) == [] and offload_warnings({"dit": pipe.transformer}) == []
    grouped = _pipe(folder, None).transformer
    apply_group_offloading(grouped, onload_device=torch.device("cpu"), offload_type="block_level",
                           num_blocks_per_group=1)
    with pytest.raises(ValueError, match="diffusers' group_offloading.*enable_group_offload"):
        execute(plan, {"dit": grouped}).__enter__()
    assert sum(len(m._forward_pre_hooks) for m in grouped.modules()) == 0
    (warning,) = offload_warnings({"dit": grouped})
    assert warning.startswith("dit carries diffusers' group offloading") and "anonymous" in warning
    assert warning in _plan(folder, grouped).warnings  # the plan a server starts with says it
    offloaded = accelerate.cpu_offload(_pipe(folder, None).transformer, execution_device="cpu")
    with pytest.raises(ValueError, match="accelerate's .*remove_all_hooks"):
        execute(plan, {"dit": offloaded}).__enter__()


def _wan(folder, cache: bool):
    transformer = WanTransformer3DModel.from_pretrained(folder / "wan").eval()
    if cache:
        transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    others = ("tokenizer", "text_encoder", "vae", "transformer_2", "boundary_ratio", "expand_timesteps")
    return WanPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), **dict.fromkeys(others))


def _wan_generate(pipe):
    embeds = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # guidance 2: each step runs the transformer twice (CFG)
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=embeds * 0.5, num_inference_steps=6, height=16,
                    width=16, num_frames=5, guidance_scale=2.0, output_type="latent",
                    generator=torch.Generator().manual_seed(3)).frames


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    torch.manual_seed(0)
    WanTransformer3DModel(  # 4 blocks of about 0.2 MiB in fp32
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=128, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).save_pretrained(root / "wan")
    return root


@pytest.mark.parametrize("path", PATHS)
def test_a_wan_pipeline_with_cfg_and_a_first_block_cache_under_the_executor(wan_folder, path):
    folder = wan_folder
    expected = _wan_generate(_wan(folder, True))
    assert not torch.equal(expected, _wan_generate(_wan(folder, False)))
    pipe = _wan(folder, True)
    plan = _plan(folder, pipe.transformer, "wan", "blocks.{i}.", room=MiB // 4)
    with execute(plan, {"dit": pipe.transformer}, prefetch=2, **PATHS[path]) as run:
        got = _wan_generate(pipe)
        stats = run.stats()
    assert torch.equal(got, expected)
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == 12  # 6 steps, two passes each
