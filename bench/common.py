"""Shared pieces of the benchmarks: synthetic checkpoints, timing, result lines."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hostmem.safetensors_map import save_file  # noqa: E402
from hostmem.units import format_size, parse_size  # noqa: E402


def bench_args(description: str, default_size: str, quick_size: str) -> argparse.Namespace:
    """The common flags: --size, --quick (small, for a smoke run) and --workdir."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--size", default=None, help=f"model size (default {default_size})")
    parser.add_argument("--quick", action="store_true", help=f"smoke run at {quick_size}")
    parser.add_argument("--workdir", default=None, help="where to write checkpoints (default: a temp folder)")
    args = parser.parse_args()
    args.size_bytes = parse_size(args.size or (quick_size if args.quick else default_size))
    return args


def workdir(args) -> tempfile.TemporaryDirectory | None:
    """A temporary folder on a real disk (never tmpfs) unless --workdir names one."""
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
        return None
    tmp = tempfile.TemporaryDirectory(prefix="hostmem-bench-", dir=os.environ.get("TMPDIR", "/var/tmp"))
    args.workdir = tmp.name
    return tmp


def write_layered_checkpoint(folder: str, total_bytes: int, tensors: int, shards: int = 4,
                             dtype=torch.bfloat16, prefix: str = "blocks") -> list[str]:
    """Write ``tensors`` equal bf16 tensors adding up to ``total_bytes``, in ``shards`` files."""
    per_tensor = max(1024, total_bytes // tensors)
    cols = 1024
    rows = max(1, per_tensor // (cols * torch.finfo(dtype).bits // 8))
    paths, per_shard = [], -(-tensors // shards)
    generator = torch.Generator().manual_seed(0)
    for shard in range(shards):
        names = range(shard * per_shard, min(tensors, (shard + 1) * per_shard))
        chunk = {f"{prefix}.{i}.weight": torch.randn(rows, cols, generator=generator).to(dtype) for i in names}
        if not chunk:
            break
        path = os.path.join(folder, f"model-{shard:05d}-of-{shards:05d}.safetensors")
        save_file(chunk, path)
        paths.append(path)
    return paths


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def report(name: str, lines: list[str], summary: dict) -> None:
    """Print readable lines, then one JSON line (sizes in bytes) for machines."""
    print(f"== {name}")
    for line in lines:
        print(f"  {line}")
    print(json.dumps({"bench": name, **summary}))


__all__ = ["bench_args", "workdir", "write_layered_checkpoint", "timed", "report", "format_size"]
