"""The other ways to offload that bench/bench_offloading.py runs, on the synthetic model.

diffusers' group offloading (block level, to disk) and accelerate's ``disk_offload``,
both with the CPU as their device, must compute what the plain model computes, bit for
bit, pass after pass, from copies of their own on disk whose page cache can be dropped;
the whole load must turn every weight into anonymous memory (what the bench's group then
kills). Real diffusers and accelerate, a real checkpoint, /proc for the memory.
"""

from __future__ import annotations

import os

import pytest
import torch

from hostmem.accountant import account
from planners.executor.offload_ways import apply_way, drop_folder_cache, load_whole
from planners.executor.synthetic import load_synthetic_dit, write_synthetic_dit

LAYERS, D = 8, 512  # 512 KiB per block in bf16: 4 MiB


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_synthetic_dit(tmp_path_factory.mktemp("ways") / "dit.safetensors", LAYERS, D)


def _inputs():
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 64, generator=gen).to(torch.bfloat16) for _ in range(2)]


@pytest.mark.parametrize("way", ["group", "disk"])
def test_each_offloader_computes_what_the_plain_model_does_from_its_own_copy(checkpoint, tmp_path, way):
    plain = load_synthetic_dit(checkpoint)
    model = load_synthetic_dit(checkpoint)
    apply_way(way, model, str(tmp_path / way))
    copied = drop_folder_cache(str(tmp_path / way))
    assert os.path.getsize(checkpoint) * 0.99 <= copied <= os.path.getsize(checkpoint) * 1.01
    with torch.no_grad():
        for x in _inputs():  # the second pass loads the copy again
            assert torch.equal(model(x), plain(x))


def test_the_whole_load_makes_every_weight_anonymous(checkpoint):
    model = load_synthetic_dit(checkpoint)
    assert account(model).totals.anonymous == 0  # mapped: page cache
    load_whole(model)
    totals = account(model).totals  # each weight's pages, classified from /proc/self/pagemap
    assert totals.anonymous >= os.path.getsize(checkpoint) - 64 * 1024 and totals.file_backed == 0
    with torch.no_grad():
        x = _inputs()[0]
        assert torch.equal(model(x), load_synthetic_dit(checkpoint)(x))


def test_an_unknown_way_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'leaf'.*group, disk, whole"):
        apply_way("leaf", torch.nn.Linear(2, 2), str(tmp_path))
