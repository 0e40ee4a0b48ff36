"""A cache root is checked before anything is written in it: a refused root holds nothing after.

A root that is a link to a tmpfs folder is refused (tmpfs pages are not reclaimable:
the cache would cost the host the memory it exists to give back), and it must be
refused before the kernel timings (``kernel_wisdom.json`` and its lock) are kept there.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

import lora_cache
from hostmem.vault import VaultError
from lora_cache.layers import checkpoint_module
from tests.conftest import write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

ROWS, COLS = 256, 512  # bf16 layers whose kernel is timed and remembered at the root


@pytest.fixture
def shm_folder():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    folder = tempfile.mkdtemp(prefix="hostmem-test-", dir="/dev/shm")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_root_linked_to_tmpfs_is_refused_before_anything_is_written_there(tmp_path, shm_folder):
    layers = {f"blocks.{i}.proj.weight": torch.randn(ROWS, COLS).to(torch.bfloat16) for i in range(2)}
    base = write_safetensors(str(tmp_path / "base.safetensors"), layers)
    changes = {f"blocks.{i}.proj": {k: v.to(torch.bfloat16) if k != "alpha" else v
                                    for k, v in lora_change(ROWS, COLS, 8, i, alpha=4).items()} for i in range(2)}
    adapter = write_adapter(str(tmp_path / "turbo.safetensors"), "comfyui", changes)
    link = tmp_path / "cache-root"
    link.symlink_to(shm_folder)
    model = checkpoint_module([base])
    with pytest.raises(VaultError, match="tmpfs|shmem|memory"):
        lora_cache.merge(model, [adapter], cache_root=str(link), progress=False)
    assert os.listdir(shm_folder) == []
    lora_cache.merge(model, [adapter], cache_root=str(tmp_path / "disk-root"), progress=False)  # the kernel is timed
    assert os.path.exists(tmp_path / "disk-root" / "kernel_wisdom.json")
