"""A diffusers pipeline under planners.execute: a Flux transformer and a CLIP text encoder,
loaded with from_pretrained (weights left as views of the checkpoint mapping), give the
same outputs bit for bit with and without the executor, while the plan streams layers
of both and releases those the page cache cannot keep."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the pipeline test runs the real diffusers")
pytest.importorskip("transformers", reason="the pipeline test runs the real transformers")

from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel  # noqa: E402
from transformers import CLIPTextConfig, CLIPTextModel  # noqa: E402

from hostmem.procfs import read_status  # noqa: E402
from planners.config import parse_config  # noqa: E402
from planners.executor import execute  # noqa: E402
from planners.startup import plan_loaded  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    torch.manual_seed(0)
    FluxTransformer2DModel(  # blocks of 9 MiB in fp32
        patch_size=1, in_channels=4, num_layers=4, num_single_layers=1, attention_head_dim=64, num_attention_heads=4,
        joint_attention_dim=256, pooled_projection_dim=256, axes_dims_rope=[16, 24, 24],
    ).save_pretrained(root / "transformer")
    CLIPTextModel(CLIPTextConfig(  # layers of 3 MiB
        hidden_size=256, intermediate_size=1024, num_hidden_layers=3, num_attention_heads=4, vocab_size=1000,
        max_position_embeddings=77, projection_dim=256,
    )).save_pretrained(root / "text_encoder")
    return root


def _load(root):
    transformer = FluxTransformer2DModel.from_pretrained(root / "transformer").eval()
    text_encoder = CLIPTextModel.from_pretrained(root / "text_encoder").eval()
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    return pipe, text_encoder


def _layers_pattern(module) -> str:
    """The text encoder's layer pattern, wherever this transformers version puts its layers."""
    name = next(n for n, m in module.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith("layers"))
    return name + ".{i}."


def _generate(pipe, text_encoder):
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    embeds = torch.randn(1, 8, 256, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        pooled = text_encoder(ids).pooler_output
        return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=2, height=32, width=32,
                    output_type="latent", generator=torch.Generator().manual_seed(3)).images


def _plan(root, pipe, text_encoder):
    reserve = read_status().rss_anon + 256 * MiB
    text = (
        "deployment: pipeline\n"
        f"host: {{limit: {reserve + 20 * MiB}B, reserve: {reserve}B, max_pinned: 0B}}\n"
        "workload: {steps: 2}\n"
        "components:\n"
        f"  dit: {{path: {root / 'transformer'}, layers: \"transformer_blocks.{{i}}.\", offload: layerwise}}\n"
        f"  text_encoder: {{path: {root / 'text_encoder'}, layers: \"{_layers_pattern(text_encoder)}\", offload: full}}\n"
    )
    config = parse_config(text, os.fspath(root / "deploy.yaml"), environ={})
    return plan_loaded(config, {"dit": pipe.transformer, "text_encoder": text_encoder})


def test_a_pipeline_gives_the_same_outputs_under_the_executor(folders):
    torch.set_num_threads(1)
    pipe, text_encoder = _load(folders)
    expected = _generate(pipe, text_encoder)
    plan = _plan(folders, pipe, text_encoder)
    modules = {"dit": pipe.transformer, "text_encoder": text_encoder}
    with execute(plan, modules, prefetch=1) as run:
        got = _generate(pipe, text_encoder)
        stats = run.stats()
    assert torch.equal(got, expected)
    assert [p.component for p in stats.passes] == ["text_encoder", "dit", "dit"]
    assert stats.roles["dit"]["released"] > 0, stats.roles
    dit = [p for p in stats.passes if p.component == "dit"]
    assert all(p.read_ahead_bytes > 0 and p.released_bytes > 0 for p in dit), dit
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for c in modules.values() for m in c.modules())
    assert hooks == 0


def test_the_device_paths_twin_swaps_a_pipelines_weights_and_puts_them_back(folders):
    """The CUDA path's parameter swap on diffusers' and transformers' own blocks (device="cpu")."""
    torch.set_num_threads(1)
    pipe, text_encoder = _load(folders)
    expected = _generate(pipe, text_encoder)
    plan = _plan(folders, pipe, text_encoder)
    modules = {"dit": pipe.transformer, "text_encoder": text_encoder}
    before = {name: [p for p in m.parameters()] for name, m in modules.items()}
    with execute(plan, modules, device="cpu", prefetch=1) as run:
        got = _generate(pipe, text_encoder)
        stats = run.stats()
    assert torch.equal(got, expected)
    assert all(p.copied_bytes > 0 for p in stats.passes)
    assert all(all(a is b for a, b in zip(m.parameters(), before[name])) for name, m in modules.items())


def test_a_pipeline_is_taken_for_its_components_as_planners_start_takes_it(folders):
    """``plan_loaded(config, pipe)`` and ``execute(plan, pipe)``: the config's ``dit`` is the
    pipeline's transformer, on the host path and the device path's twin. A lone module where
    the mapping belongs is refused naming the mapping."""
    torch.set_num_threads(1)
    pipe, text_encoder = _load(folders)
    expected = _generate(pipe, text_encoder)
    reserve = read_status().rss_anon + 256 * MiB
    text = (f"deployment: pipeline\nhost: {{limit: {reserve + 20 * MiB}B, reserve: {reserve}B, max_pinned: 0B}}\n"
            "workload: {steps: 2}\ncomponents:\n"
            f"  dit: {{path: {folders / 'transformer'}, layers: \"transformer_blocks.{{i}}.\", offload: layerwise}}\n")
    plan = plan_loaded(parse_config(text, os.fspath(folders / "deploy.yaml"), environ={}), pipe, quiet=True)
    for options in ({}, {"device": "cpu"}):
        with execute(plan, pipe, prefetch=1, **options) as run:
            got = _generate(pipe, text_encoder)
        assert torch.equal(got, expected)
        assert [p.component for p in run.stats().passes] == ["dit", "dit"]
    with pytest.raises(ValueError, match=r"FluxTransformer2DModel was given where \{config name: module\}.*'dit'"):
        execute(plan, pipe.transformer)
