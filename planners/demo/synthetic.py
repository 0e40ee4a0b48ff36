"""A synthetic checkpoint set for the demo: a DiT, a text encoder and a LoRA adapter.

The DiT follows a Wan-style block layout (``blocks.{i}.self_attn.q``, ``cross_attn``,
``ffn.0``/``ffn.2``, norms, modulation) in bf16; the text encoder a T5-style encoder;
the adapter the ComfyUI/lightx2v layout published for such DiTs
(``diffusion_model.<module>.lora_down.weight``, ``.lora_up.weight``, ``.alpha``).

The LoRA targets are chosen so that their share of the DiT matches the seed case
(38 GB of 61.7 GB): self-attention q/k/v/o, cross-attention q/o and ``ffn.0``, which
is 10 of every 16 d x d blocks of weights (62.5%).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from hostmem.safetensors.mapping import read_header, save_file

from .progress import SizeBar
from hostmem.write_way import measure, read_back

__all__ = ["SyntheticSet", "dit_dims", "write_synthetic_set", "LORA_TARGETS"]

# Per block, in units of d*d weights: self-attn 4, cross-attn 4, ffn 4 + 4 (d -> 4d -> d).
_BLOCK_UNITS = 16
LORA_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o", "ffn.0")
TEXT_ENCODER_SHARE = 15.0 / 61.7  # the seed case's text encoder against its DiT


@dataclass(frozen=True)
class SyntheticSet:
    """Where the demo's files are and how they are shaped."""

    dit_path: str
    text_encoder_path: str
    adapter_path: str
    hidden: int
    blocks: int
    dit_bytes: int
    text_encoder_bytes: int
    lora_target_bytes: int
    rank: int


def dit_dims(dit_bytes: int, target_blocks: int = 40) -> tuple[int, int]:
    """Return ``(hidden, blocks)``: about ``target_blocks`` bf16 blocks adding up to ``dit_bytes``."""
    hidden = int(math.sqrt(dit_bytes / (target_blocks * _BLOCK_UNITS * 2)))
    hidden = max(64, hidden // 64 * 64)
    blocks = max(2, round(dit_bytes / (_BLOCK_UNITS * hidden * hidden * 2)))
    return hidden, blocks


class Normals:
    """Normally distributed bf16 weights, fast: one pool of values drawn once from ``gen``,
    each weight built of runs of it that start at offsets ``gen`` draws.

    Drawing every value (2.5 billion for the 4 GiB DiT and its text encoder) ran on one
    core at a few hundred MB/s and took most of ``make demo``'s minute; copying runs of a
    pool runs at memory speed on every core. The weights are as deterministic as the
    seed, their values as normal; runs repeat across weights, which nothing here minds
    (the cache keys hash whole files, and the files differ).
    """

    POOL = 1 << 24  # values drawn (64 MiB of fp32)
    RUN = 1 << 20  # values per run

    def __init__(self, gen: torch.Generator):
        self.gen = gen
        self.pool = torch.randn(self.POOL, generator=gen)

    def __call__(self, rows: int, cols: int, scale: float) -> torch.Tensor:
        out = torch.empty(rows * cols, dtype=torch.bfloat16)
        count = -(-out.numel() // self.RUN)
        starts = torch.randint(0, self.POOL - self.RUN + 1, (count,), generator=self.gen).tolist()
        for run, start in enumerate(starts):
            piece = out[run * self.RUN : (run + 1) * self.RUN]
            torch.mul(self.pool[start : start + piece.numel()], scale, out=piece)  # cast to bf16 as it is written
        return out.view(rows, cols)


def _dit_block(i: int, d: int, normals: Normals) -> dict[str, torch.Tensor]:
    def w(rows: int, cols: int) -> torch.Tensor:
        return normals(rows, cols, 1 / math.sqrt(cols))

    p = f"blocks.{i}."
    out = {}
    for attn in ("self_attn", "cross_attn"):
        for proj in ("q", "k", "v", "o"):
            out[f"{p}{attn}.{proj}.weight"] = w(d, d)
            out[f"{p}{attn}.{proj}.bias"] = torch.zeros(d, dtype=torch.bfloat16)
        out[f"{p}{attn}.norm_q.weight"] = torch.ones(d, dtype=torch.bfloat16)
        out[f"{p}{attn}.norm_k.weight"] = torch.ones(d, dtype=torch.bfloat16)
    out[f"{p}ffn.0.weight"] = w(4 * d, d)
    out[f"{p}ffn.0.bias"] = torch.zeros(4 * d, dtype=torch.bfloat16)
    out[f"{p}ffn.2.weight"] = w(d, 4 * d)
    out[f"{p}ffn.2.bias"] = torch.zeros(d, dtype=torch.bfloat16)
    out[f"{p}norm3.weight"] = torch.ones(d, dtype=torch.bfloat16)
    out[f"{p}modulation"] = torch.zeros(1, 6, d, dtype=torch.bfloat16)
    return out


MEASURE_FROM = 1 << 30  # a smaller set is absorbed by the page cache either way: written buffered


def _save(tensors: dict[str, torch.Tensor], path: str, way: str) -> None:
    """Write a large file ``way`` (:mod:`hostmem.write_way`): it ends up on disk and in the page cache."""
    if way == "direct":
        save_file(tensors, path, direct=True)
        read_back(path)
    else:
        save_file(tensors, path, writeback=True)


def _write_dit(folder: str, d: int, blocks: int, normals: Normals, bar: SizeBar, way: str) -> str:
    """One shard per 8 blocks, with an index file, as published DiTs ship."""
    os.makedirs(folder, exist_ok=True)
    per_shard = 8
    shards = -(-blocks // per_shard)
    for shard in range(shards):
        tensors = {}
        for i in range(shard * per_shard, min(blocks, (shard + 1) * per_shard)):
            tensors.update(_dit_block(i, d, normals))
        if shard == 0:
            tensors["patch_embedding.weight"] = normals(d, 64, 1 / 8)
            tensors["head.head.weight"] = normals(64, d, 1 / 8)
        _save(tensors, os.path.join(folder, f"diffusion_pytorch_model-{shard + 1:05d}-of-{shards:05d}.safetensors"), way)
        bar.update(sum(t.nbytes for t in tensors.values()))
    return folder


def _write_text_encoder(path: str, d: int, total_bytes: int, normals: Normals, way: str) -> int:
    """A T5-style encoder: q/k/v/o and a gated feed-forward per block, bf16."""
    per_block = 4 * d * d + 3 * d * (2 * d)
    blocks = max(1, round(total_bytes / (per_block * 2)))
    tensors = {"shared.weight": normals(1024, d, 1 / 8)}
    for i in range(blocks):
        p = f"encoder.block.{i}.layer."
        for proj in ("q", "k", "v", "o"):
            tensors[f"{p}0.SelfAttention.{proj}.weight"] = normals(d, d, 1 / 32)
        tensors[f"{p}1.DenseReluDense.wi_0.weight"] = normals(2 * d, d, 1 / 32)
        tensors[f"{p}1.DenseReluDense.wi_1.weight"] = normals(2 * d, d, 1 / 32)
        tensors[f"{p}1.DenseReluDense.wo.weight"] = normals(d, 2 * d, 1 / 32)
    _save(tensors, path, way)
    return sum(t.nbytes for t in tensors.values())


def _write_adapter(path: str, d: int, blocks: int, rank: int, gen: torch.Generator) -> None:
    """A rank-``rank`` adapter in the ComfyUI/lightx2v layout, alpha = rank."""
    tensors = {}
    for i in range(blocks):
        for target in LORA_TARGETS:
            out_features = 4 * d if target == "ffn.0" else d
            key = f"diffusion_model.blocks.{i}.{target}"
            tensors[f"{key}.lora_down.weight"] = (torch.randn(rank, d, generator=gen) / math.sqrt(d)).to(torch.bfloat16)
            tensors[f"{key}.lora_up.weight"] = (torch.randn(out_features, rank, generator=gen) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, path, metadata={"format": "pt"})


def write_synthetic_set(folder: str, dit_bytes: int, rank: int = 32, progress: bool = True,
                        seed: int = 0) -> SyntheticSet:
    """Write the DiT folder, the text encoder and the adapter under ``folder``.

    From :data:`MEASURE_FROM` bytes the two ways of writing are timed here first
    (:func:`hostmem.write_way.measure`, a few seconds) and the faster one writes the set; the
    bar names it."""
    gen = torch.Generator().manual_seed(seed)
    hidden, blocks = dit_dims(dit_bytes)
    te_target = int(dit_bytes * TEXT_ENCODER_SHARE)
    way = "buffered"
    if dit_bytes + te_target >= MEASURE_FROM:
        way = measure(folder).faster
    with SizeBar(f"writing the DiT and text encoder ({way})", dit_bytes + te_target, enabled=progress) as bar:
        normals = Normals(gen)
        dit_path = _write_dit(os.path.join(folder, "transformer"), hidden, blocks, normals, bar, way)
        te_path = os.path.join(folder, "text_encoder.safetensors")
        te_bytes = _write_text_encoder(te_path, hidden, te_target, normals, way)
        bar.update(te_bytes)
    adapter_path = os.path.join(folder, "turbo_lora_rank%d.safetensors" % rank)
    _write_adapter(adapter_path, hidden, blocks, rank, gen)
    dit_total = sum(
        read_header(os.path.join(dit_path, name)).data_bytes for name in sorted(os.listdir(dit_path))
    )
    target_bytes = blocks * 10 * hidden * hidden * 2
    return SyntheticSet(dit_path, te_path, adapter_path, hidden, blocks, dit_total, te_bytes, target_bytes, rank)
