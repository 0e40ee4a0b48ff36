"""The tiny diffusers pipelines the executor's step-cache tests run (diffusers' own caching
hooks, cache-dit): a Flux of 6 blocks and a Wan of 4 blocks run with CFG, each generated
from fixed seeds, and the plan that streams their blocks through a small page cache."""

from __future__ import annotations

import os

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    WanPipeline,
    WanTransformer3DModel,
)

from hostmem.procfs import read_status
from planners.config import parse_config
from planners.executor import execute
from planners.startup import plan_loaded

from .conftest import EXECUTOR_PATHS

MiB = 1 << 20
STEPS = 6


def write_flux(root) -> None:
    """A Flux transformer of 6 blocks of about 2.3 MiB in fp32 under ``root/transformer``."""
    torch.manual_seed(0)
    FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=6, num_single_layers=1, attention_head_dim=32, num_attention_heads=4,
        joint_attention_dim=64, pooled_projection_dim=64, axes_dims_rope=[8, 12, 12],
    ).save_pretrained(root / "transformer")


def flux_pipe(folder) -> FluxPipeline:
    """A fresh Flux pipeline of the transformer under ``folder`` (no text encoders, no VAE)."""
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer").eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)


def flux_generate(pipe) -> torch.Tensor:
    """The latents of 6 steps from fixed prompt embeddings and seed."""
    embeds = torch.randn(1, 8, 64, generator=torch.Generator().manual_seed(2))
    pooled = torch.randn(1, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=STEPS, height=32, width=32,
                    output_type="latent", generator=torch.Generator().manual_seed(3)).images


def write_wan(root) -> None:
    """A Wan transformer of 4 blocks of about 0.2 MiB in fp32 under ``root/wan``."""
    torch.manual_seed(0)
    WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=128, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).save_pretrained(root / "wan")


def wan_pipe(folder) -> WanPipeline:
    """A fresh Wan pipeline of the transformer under ``folder`` (no text encoder, no VAE)."""
    transformer = WanTransformer3DModel.from_pretrained(folder / "wan").eval()
    others = ("tokenizer", "text_encoder", "vae", "transformer_2", "boundary_ratio", "expand_timesteps")
    return WanPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), **dict.fromkeys(others))


def wan_generate(pipe) -> torch.Tensor:
    """The latents of 6 steps, each running the transformer twice (guidance 2: CFG)."""
    embeds = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, negative_prompt_embeds=embeds * 0.5, num_inference_steps=STEPS, height=16,
                    width=16, num_frames=5, guidance_scale=2.0, output_type="latent",
                    generator=torch.Generator().manual_seed(3)).frames


def layer_plan(folder, transformer, sub="transformer", layers="transformer_blocks.{i}.", room=2 * MiB):
    """The plan of a host whose page cache holds ``room`` beside this process: the blocks
    are streamed and most of them released at every pass."""
    reserve = read_status().rss_anon + 256 * MiB
    text = (
        "deployment: caching\n"
        f"host: {{limit: {reserve + room}B, reserve: {reserve}B, max_pinned: 0B}}\n"
        f"workload: {{steps: {STEPS}}}\n"
        "components:\n"
        f"  dit: {{path: {folder / sub}, layers: \"{layers}\", offload: layerwise}}\n"
    )
    config = parse_config(text, os.fspath(folder / "deploy.yaml"), environ={})
    return plan_loaded(config, {"dit": transformer}, quiet=True)


def wan_plan(folder, transformer):
    """:func:`layer_plan` for the tiny Wan: its 4 blocks through a quarter MiB."""
    return layer_plan(folder, transformer, "wan", "blocks.{i}.", room=MiB // 4)


def generate_under_executor(pipe, plan, generate, path: str):
    """``generate(pipe)`` with the pipeline's transformer under the executor, reading two
    layers ahead on ``path`` (a key of ``EXECUTOR_PATHS``): the output and the executor's stats."""
    with execute(plan, {"dit": pipe.transformer}, prefetch=2, **EXECUTOR_PATHS[path]) as run:
        return generate(pipe), run.stats()
