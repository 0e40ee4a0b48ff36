"""A synthetic DiT-shaped model mapped read-only from a real checkpoint.

For the executor's tests, its benchmark and the device check: ``layers`` blocks of
one ``d x d`` projection each (``blocks.{i}.proj.weight``) between an input and an
output projection (the tensors outside every layer), written as safetensors and
mapped back read-only (:func:`hostmem.safetensors.mapping.open_readonly`), so every
weight is page cache the executor can read ahead and release; or, ``loader="safetensors"``,
by ``safetensors.torch.load_file`` (what diffusers users have: a private writable
mapping of 4 KiB pages).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from hostmem.safetensors.mapping import load_readonly, save_file

__all__ = ["SyntheticDiT", "write_synthetic_dit", "load_synthetic_dit", "LAYER_PATTERN", "LOADERS"]

LOADERS = ("hostmem", "safetensors")

LAYER_PATTERN = "blocks.{i}."


class _Block(nn.Module):
    def __init__(self, d: int, dtype: torch.dtype):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=False, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class SyntheticDiT(nn.Module):
    """``x -> head(blocks(embed(x)))``, every block reading its whole weight once per pass."""

    def __init__(self, layers: int, d: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.embed = nn.Linear(64, d, bias=False, dtype=dtype, device="meta")
        self.blocks = nn.ModuleList(_Block(d, dtype) for _ in range(layers))
        self.head = nn.Linear(d, 64, bias=False, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor, order=None) -> torch.Tensor:
        """Every block in turn, or the blocks ``order`` lists (indices: skips, repeats, any order),
        as a server's step caching or a partial pass runs them."""
        x = self.embed(x)
        for block in self.blocks if order is None else (self.blocks[i] for i in order):
            x = block(x)
        return self.head(x)


def write_synthetic_dit(path: str | os.PathLike, layers: int, d: int, dtype: torch.dtype = torch.bfloat16,
                        seed: int = 0) -> str:
    """Write the checkpoint (scaled normals, so activations stay finite) and return its path."""
    gen = torch.Generator().manual_seed(seed)
    scale = d ** -0.5
    tensors = {"embed.weight": (torch.randn(d, 64, generator=gen) * 0.125).to(dtype),
               "head.weight": (torch.randn(64, d, generator=gen) * scale).to(dtype)}
    for i in range(layers):
        tensors[f"blocks.{i}.proj.weight"] = (torch.randn(d, d, generator=gen) * scale).to(dtype)
    save_file(tensors, path, fsync=True)
    return os.fspath(path)


def load_synthetic_dit(path: str | os.PathLike, loader: str = "hostmem") -> SyntheticDiT:
    """The model with every weight a view of a mapping of ``path`` (nothing copied): hostmem's
    read-only one, or safetensors' own (``loader="safetensors"``)."""
    if loader == "safetensors":
        from safetensors.torch import load_file

        tensors = load_file(os.fspath(path))
    else:
        tensors = load_readonly(path)
    layers = sum(1 for name in tensors if name.startswith("blocks."))
    d, dtype = tensors["head.weight"].shape[1], tensors["head.weight"].dtype
    model = SyntheticDiT(layers, d, dtype).requires_grad_(False)
    model.load_state_dict(tensors, assign=True)
    return model.eval()
