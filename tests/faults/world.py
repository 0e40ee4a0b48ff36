"""A small deployment to break: a checkpoint, an adapter, and the in-place merge they give.

Every fault test builds the cache for real, breaks something for real, starts again, and
compares every merged weight with :func:`reference`, the in-place merge of the same
files (``torch.equal``: the cached path must give the very same bytes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import torch

import lora_cache
from lora_cache.placement.layers import checkpoint_module
from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

LAYERS, ROWS, COLS = 6, 64, 128  # 32 KiB layers: small, and several of them
DRIVER = os.path.join(os.path.dirname(__file__), "driver.py")


@dataclass
class World:
    folder: str
    base: str
    adapter: str

    def path(self, *parts: str) -> str:
        return os.path.join(self.folder, *parts)


def make_world(folder, seed: int = 0) -> World:
    """Write the checkpoint and a kohya-style adapter on every layer."""
    folder = str(folder)
    gen = torch.Generator().manual_seed(seed)
    layers = {f"blocks.{i}.proj.weight": torch.randn(ROWS, COLS, generator=gen) for i in range(LAYERS)}
    base = write_safetensors(os.path.join(folder, "base.safetensors"), layers)
    changes = {f"blocks.{i}.proj": lora_change(ROWS, COLS, 4, i, alpha=2) for i in range(LAYERS)}
    adapter = write_adapter(os.path.join(folder, "turbo.safetensors"), "comfyui", changes)
    return World(folder, base, adapter)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(base: str, adapter: str) -> dict[str, torch.Tensor]:
    """The in-place merge of ``adapter`` into ``base``: what every start must serve."""
    model = checkpoint_module([base])
    lora_cache.merge(model, [adapter], enabled=False, progress=False)
    return weights(model)


def start(base: str, adapter: str, roots) -> tuple[dict[str, torch.Tensor], "lora_cache.MergeStats"]:
    """A server's start, in this process: map the checkpoint, merge through the cache; its
    weights as served at once, and its stats once what it built is sealed (behind it,
    where it was written through the page cache)."""
    model = checkpoint_module([base])
    stats = lora_cache.merge(model, [adapter], cache_root=roots, progress=False)
    merged = weights(model)
    assert lora_cache.wait_sealed(timeout=120)
    lora_cache.unmerge(model)
    return merged, stats


def assert_same(served: dict, expected: dict) -> None:
    assert served.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(served[name], tensor), f"{name} differs from the in-place merge"


def build_in_child(world: World, root: str, kill_at: list[int] = (), behind: str = "") -> subprocess.CompletedProcess:
    """Build the cache in a real child process; with ``kill_at`` [N, ...] one forked build
    per N into ``root-N``, each SIGKILLed at its Nth write, fsync or rename (``driver.py``);
    ``behind``: a build sealed behind its start, on a base ``"hashed"`` before it or one
    ``"folded"`` (hashed beside it)."""
    argv = [sys.executable, DRIVER, *([f"--behind={behind}"] if behind else []), world.base, world.adapter, root,
            *map(str, kill_at)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=240)


def leftovers(root: str) -> list[str]:
    """Temporary files anywhere under ``root``."""
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.startswith(".tmp-")]


def combination_folder(root: str) -> str:
    """The one combination folder under ``root``."""
    cache = os.path.join(root, "lora_merge_cache")
    (key,) = [n for n in os.listdir(cache) if len(n) == 64 and os.path.isdir(os.path.join(cache, n))]
    return os.path.join(cache, key)


def flip_byte(path: str, offset: int) -> None:
    """Change one byte in place (same size, same inode)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def flip_byte_keeping_times(path: str, offset: int) -> None:
    """Change one byte and put the old atime and mtime back (what ``cp -p`` or ``tar`` leave)."""
    before = os.stat(path)
    flip_byte(path, offset)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
