"""Cache roots and the kernel timings kept in them: checked before written, one root for every entry point.

A root that is a link to a tmpfs folder is refused (tmpfs pages are not reclaimable:
the cache would cost the host the memory it exists to give back), and it must be
refused before the kernel timings (``kernel_wisdom.json`` and its lock) are kept there.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest
import torch

import lora_cache
from hostmem.vault import VaultError
from lora_cache.placement.layers import checkpoint_module
from tests.conftest import run_python, write_safetensors
from tests.fresh_fork import TORCH
from tests.lora_cache.test_adapters import lora_change, write_adapter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


# Merges (or switches to) one bf16 adapter on a stack model, in a fresh process (so only
# the roots' kernel wisdom, not this process's memory, decides the kernel); prints the mode.
_START = r"""
import os, sys
import torch, lora_cache
from tests.lora_cache.switching.test_runtime_lora import stack_adapter, stack_model
folder, how, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
model = stack_model(folder, 256, 4, torch.bfloat16)
adapter = stack_adapter(os.path.join(folder, "a.safetensors"), 256, 4, 1, rank=8, dtype=torch.bfloat16)
if how == "merge":
    print(lora_cache.merge(model, [adapter], cache_root=roots, progress=False).cache_key)
else:
    print(lora_cache.set_adapters(model, [adapter], cache_root=roots[0], background=False).mode)  # takes one root
"""


def _start(folder, how: str, *roots: str) -> str:
    done = run_python(_START, str(folder), how, *roots, cwd=REPO, timeout=300, forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def _image_of_other_choices(tmp_path):
    """A root whose kernel wisdom records torch's bf16 addmm as not rounding once (no kernel
    to choose: every layer summed in fp32 rows), where this machine's own timing would name
    the bf16 kernel in the key; skips where the bf16 addmm does not round once here."""
    scratch = tmp_path / "scratch"
    _start(tmp_path, "merge", str(scratch))
    wisdom = json.loads((scratch / "kernel_wisdom.json").read_text())
    facts = wisdom["facts"]
    if not any(f.get("rounds_once") for f in facts.values()):
        pytest.skip("torch's bf16 addmm does not round once here: there is no kernel to choose")
    image = tmp_path / "image"
    image.mkdir()
    (image / "kernel_wisdom.json").write_text(json.dumps(
        {**wisdom, "entries": {}, "facts": {k: {"rounds_once": False} for k in facts}}))
    return image


def test_merge_and_set_adapters_choose_kernels_from_a_read_only_roots_wisdom(tmp_path, read_only_copy):
    """A read-only root (a cache baked into an image) keeps the kernel choices its keys
    were made with: merge and set_adapters both read them, so both find what it holds.

    The image here was built where torch's bf16 addmm was recorded as not rounding once
    (no kernel to choose: every layer summed in fp32 rows), so a start that timed its
    kernels anew on this machine would name the bf16 kernel in its key, and miss."""
    image = _image_of_other_choices(tmp_path)
    built = _start(tmp_path, "merge", str(image))  # the image's build, under its own choices
    baked = read_only_copy(str(image))
    assert _start(tmp_path, "merge", baked) == built
    assert _start(tmp_path, "switch", baked) == "cached"


def test_a_server_whose_own_root_comes_first_makes_the_key_of_an_image_in_a_root_after_it(tmp_path):
    """An image built by ``hostmem lora merge`` into a root that a server lists after its
    own (writable, empty) root: the image's recorded kernel choices make the key, so the
    server finds the image instead of timing anew, keying otherwise and building again."""
    image = _image_of_other_choices(tmp_path)
    built = _start(tmp_path, "merge", str(image))
    own = tmp_path / "own"
    assert _start(tmp_path, "merge", str(own), str(image)) == built
    assert not (own / "lora_merge_cache" / built).exists()  # served from the image, not built again


def test_set_adapters_takes_an_ordered_list_of_roots_as_merge_does(tmp_path):
    from tests.lora_cache.switching.test_runtime_lora import stack_adapter, stack_model

    roots = [str(tmp_path / "first"), str(tmp_path / "second")]
    adapter = stack_adapter(str(tmp_path / "a.safetensors"), 64, 2, 1, rank=4, dtype=torch.bfloat16)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = stack_model(str(tmp_path / "one"), 64, 2, torch.bfloat16)
    assert lora_cache.set_adapters(first, [adapter], cache_root=roots, background=False).mode == "built"
    assert any(len(n) == 64 for n in os.listdir(tmp_path / "first" / "lora_merge_cache"))  # built in the first
    second = stack_model(str(tmp_path / "two"), 64, 2, torch.bfloat16)
    assert lora_cache.set_adapters(second, [adapter], cache_root=roots, background=False).mode == "cached"
