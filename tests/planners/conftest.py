"""Fixtures of the planner tests: real checkpoints, modules mapped from them, configs."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from hostmem.safetensors_map import load_readonly
from planners.checkpoint import checkpoint_files
from tests.conftest import write_safetensors

MiB = 1024 * 1024


def write_checkpoint(folder, layers: int, layer_bytes: int, prefix: str = "blocks", rest_bytes: int = 0,
                     tensors_per_layer: int = 2, files: int = 1) -> str:
    """A real safetensors checkpoint of ``layers`` layers of ``layer_bytes`` each (bf16)."""
    os.makedirs(folder, exist_ok=True)
    per_tensor = layer_bytes // tensors_per_layer // 2  # bf16 elements
    shards: list[dict] = [{} for _ in range(files)]
    for i in range(layers):
        for j in range(tensors_per_layer):
            shards[i * files // layers][f"{prefix}.{i}.w{j}"] = torch.full((per_tensor,), float(i), dtype=torch.bfloat16)
    if rest_bytes:
        shards[0]["embed.weight"] = torch.ones(rest_bytes // 2, dtype=torch.bfloat16)
    for n, tensors in enumerate(shards):
        write_safetensors(os.path.join(folder, f"model-{n:05d}.safetensors"), tensors)
    return os.fspath(folder)


class MappedTree(torch.nn.Module):
    """A module tree whose parameters are read-only views into checkpoint files."""


def mapped_module(path) -> torch.nn.Module:
    """Map every tensor of a checkpoint read-only into a module, named like its tensors."""
    root = MappedTree()
    for file in checkpoint_files(os.fspath(path)):
        for name, tensor in load_readonly(file).items():
            *parents, leaf = name.split(".")
            node = root
            for part in parents:
                if not hasattr(node, part):
                    node.add_module(part, MappedTree())
                node = getattr(node, part)
            node.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


@pytest.fixture
def write_config(tmp_path):
    """``write_config(text, name="deploy.yaml")`` writes a dedented config under tmp_path."""

    def write(text: str, name: str = "deploy.yaml") -> str:
        path = tmp_path / name
        path.write_text(textwrap.dedent(text).lstrip())
        return os.fspath(path)

    return write
