"""Fixtures of the planner tests: real checkpoints, modules mapped from them, configs."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from lora_cache.placement.layers import checkpoint_module
from planners.checkpoint import checkpoint_files
from tests.conftest import write_safetensors

MiB = 1024 * 1024
# The executor's two paths, as its tests run them: the host's (read-ahead advised, waited for
# at the layer) and the device path's CPU twin (copies into a pool of buffers).
EXECUTOR_PATHS = {"host": {"read_ahead": "madvise"}, "twin": {"device": "cpu"}}


def synthetic_plan(checkpoint, room: int, model=None):
    """The plan of the synthetic model at ``checkpoint`` (``planners.executor.synthetic``), or
    of ``model`` made from it, on a host whose page cache holds ``room`` bytes beside this process."""
    from hostmem.procfs import read_status
    from planners.executor.synthetic import load_synthetic_dit
    from planners.executor.trial import synthetic_config
    from planners.startup import plan_loaded

    reserve = read_status().rss_anon + 256 * MiB
    config = synthetic_config(os.fspath(checkpoint), reserve + room, reserve, 0, 3)
    return plan_loaded(config, {"dit": model if model is not None else load_synthetic_dit(checkpoint)}, quiet=True)


@pytest.fixture
def one_thread():
    """One compute thread: on busy cores a second one spins at every small matmul (100x
    slower), and the executor's tests compare outputs, not speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def write_checkpoint(folder, layers: int, layer_bytes: int, prefix: str = "blocks", rest_bytes: int = 0,
                     tensors_per_layer: int = 2, files: int = 1, cols: int | None = None) -> str:
    """A real safetensors checkpoint of ``layers`` layers of ``layer_bytes`` each (bf16).

    Tensors are ``{prefix}.{i}.w{j}``: flat, or with ``cols`` matrices ``{prefix}.{i}.w{j}.weight``
    of ``cols`` columns, the shape a LoRA adapter targets.
    """
    os.makedirs(folder, exist_ok=True)
    per_tensor = layer_bytes // tensors_per_layer // 2  # bf16 elements
    shape, suffix = ((per_tensor,), "") if cols is None else ((per_tensor // cols, cols), ".weight")
    shards: list[dict] = [{} for _ in range(files)]
    for i in range(layers):
        for j in range(tensors_per_layer):
            name = f"{prefix}.{i}.w{j}{suffix}"
            shards[i * files // layers][name] = torch.full(shape, float(i), dtype=torch.bfloat16)
    if rest_bytes:
        shards[0]["embed.weight"] = torch.ones(rest_bytes // 2, dtype=torch.bfloat16)
    for n, tensors in enumerate(shards):
        write_safetensors(os.path.join(folder, f"model-{n:05d}.safetensors"), tensors)
    return os.fspath(folder)


def mapped_module(path) -> torch.nn.Module:
    """Every tensor of a checkpoint (file or folder) as a read-only mapped parameter, named like it."""
    return checkpoint_module(checkpoint_files(os.fspath(path)))


def pins_config(deployment: str, limit: str, reserve: str, dit_layers: str = "blocks.{i}.",
                text_encoder: bool = True) -> str:
    """The config of a pin test: a streamed DiT (and a fully offloaded text encoder)
    under ``limit`` less ``reserve``, every layer pinnable (``max_pinned: 100%``)."""
    te = '\n  text_encoder: {path: te, layers: "enc.{i}.", offload: full}' if text_encoder else ""
    return (f"deployment: {deployment}\nhost: {{limit: {limit}, reserve: {reserve}, max_pinned: 100%}}\n"
            f"workload: {{steps: 2}}\ncomponents:\n"
            f'  dit: {{path: dit, layers: "{dit_layers}", offload: layerwise}}{te}\n')


def load_dit_and_text_encoder(folder, config_text: str, dit_layer_bytes: int):
    """``(config, {"dit": ..., "text_encoder": ...})``: 12 DiT layers of ``dit_layer_bytes``
    and 2 text-encoder layers of 4 MiB written as checkpoints under ``folder``, mapped
    read-only, with ``config_text`` loaded (no environment overrides)."""
    from planners.config import load_config

    write_checkpoint(folder / "dit", 12, dit_layer_bytes)
    write_checkpoint(folder / "te", 2, 4 * MiB, prefix="enc")
    (folder / "deploy.yaml").write_text(config_text)
    config = load_config(folder / "deploy.yaml", environ={})
    return config, {"dit": mapped_module(folder / "dit"), "text_encoder": mapped_module(folder / "te")}


@pytest.fixture
def write_config(tmp_path):
    """``write_config(text, name="deploy.yaml")`` writes a dedented config under tmp_path."""

    def write(text: str, name: str = "deploy.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip())
        return os.fspath(path)

    return write


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    """The tiny Flux transformer of the step-cache tests, written once per module
    (``tests/planners/tiny_pipelines.py``)."""
    from tests.planners.tiny_pipelines import write_flux

    root = tmp_path_factory.mktemp("flux")
    write_flux(root)
    return root


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """The tiny Wan transformer of the step-cache tests, written once per module."""
    from tests.planners.tiny_pipelines import write_wan

    root = tmp_path_factory.mktemp("wan")
    write_wan(root)
    return root
