"""diffusers' own LoRA calls on a pipeline under planners.execute: load_lora_weights between steps,
set_adapters with two adapters and strengths, fuse_lora (peft's merge: in place through ``.data``,
no address or version changes) and unfuse_lora. Each generation equals the same calls without the
executor, bit for bit, on the host path and the device path's twin."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the LoRA test runs the real diffusers")
pytest.importorskip("peft", reason="diffusers' LoRA runs on peft")

from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel  # noqa: E402

from hostmem.procfs import read_status  # noqa: E402
from planners.config import parse_config  # noqa: E402
from planners.executor import execute  # noqa: E402
from planners.startup import plan_loaded  # noqa: E402
from tests.clients import tiny_models as tm  # noqa: E402
from tests.planners.conftest import EXECUTOR_PATHS  # noqa: E402

MiB = 1 << 20
PATHS = EXECUTOR_PATHS
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    FluxTransformer2DModel(  # 4 blocks of about 0.6 MiB in fp32
        patch_size=1, in_channels=4, num_layers=4, num_single_layers=1, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6],
    ).save_pretrained(root / "transformer")
    first = tm.write_adapters("flux", root / "transformer", root / "a", seed=1)["diffusers_meta"]
    second = tm.write_adapters("flux", root / "transformer", root / "b", seed=2)["diffusers_meta"]
    return root, first, second


def _pipe(root):
    transformer = FluxTransformer2DModel.from_pretrained(root / "transformer").eval()
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)


def _generate(pipe):
    embeds = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    pooled = torch.randn(1, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        return pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=2, height=32, width=32,
                    output_type="latent", generator=torch.Generator().manual_seed(3)).images


def _script(pipe, first, second, settle=lambda: None):
    """``settle``: the executor's reads and copies end first, so a weight written in place after
    cannot race a copy of it (the write must be caught, not missed by luck)."""
    outs = [_generate(pipe)]
    pipe.load_lora_weights(first, adapter_name="a")
    outs.append(_generate(pipe))
    pipe.load_lora_weights(second, adapter_name="b")
    pipe.set_adapters(["a", "b"], [1.0, -0.5])
    outs.append(_generate(pipe))
    settle()
    pipe.fuse_lora(adapter_names=["a", "b"])
    outs.append(_generate(pipe))
    settle()
    pipe.unfuse_lora()
    pipe.set_adapters(["a"], [0.25])
    outs.append(_generate(pipe))
    return outs


def _plan(root, transformer):
    reserve = read_status().rss_anon + 256 * MiB
    text = (
        "deployment: lora\n"
        f"host: {{limit: {reserve + MiB}B, reserve: {reserve}B, max_pinned: 0B}}\n"
        "workload: {steps: 2}\n"
        "components:\n"
        f"  dit: {{path: {root / 'transformer'}, layers: \"transformer_blocks.{{i}}.\", offload: layerwise}}\n"
    )
    return plan_loaded(parse_config(text, os.fspath(root / "deploy.yaml"), environ={}), {"dit": transformer},
                       quiet=True)


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")
@pytest.mark.parametrize("path", PATHS)
def test_diffusers_lora_calls_between_generations_give_the_outputs_without_the_executor(folders, path):
    root, first, second = folders
    expected = _script(_pipe(root), first, second)
    assert len({float(o.flatten()[0]) for o in expected}) >= 4  # the adapters did change the outputs
    pipe = _pipe(root)
    with execute(_plan(root, pipe.transformer), {"dit": pipe.transformer}, prefetch=2, **PATHS[path]) as run:
        got = _script(pipe, first, second, run.settle)
        stats = run.stats()
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"generation {i}: largest difference {(a - b).abs().max()}"
    assert stats.roles["dit"]["released"] > 0 and len(stats.passes) == 10
