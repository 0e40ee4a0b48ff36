"""Where a merge sums by default: where each weight lies, on a GPU host too.

Host weights (every weight the cache holds) are summed on the CPU unless ``device=``
says otherwise, so a merge on a GPU host neither starts CUDA nor keys its cache apart
from a CPU host's; a weight already on a GPU is merged in place there. The tests that
need a GPU skip without one; their CPU twin is the first test.
"""

from __future__ import annotations

import json

import pytest
import torch

import lora_cache
from lora_cache.orchestrate import MERGE_POLICY
from tests.conftest import run_python
from tests.lora_cache.test_adapters import mapped_model
from tests.lora_cache.test_orchestrate import _setup

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _policy(tmp_path, stats) -> str:
    manifest = tmp_path / "cache" / "lora_merge_cache" / stats.cache_key / "manifest.json"
    return json.loads(manifest.read_text())["inputs"]["merge_policy"]


def test_host_weights_are_summed_on_the_cpu_unless_a_device_is_named(tmp_path):
    model, adapter = _setup(tmp_path)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    assert _policy(tmp_path, stats).startswith(f"{MERGE_POLICY}@cpu")
    lora_cache.unmerge(model)
    named = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", device="cpu", progress=False)
    assert (named.cache_key, named.hit) == (stats.cache_key, stats.layers)  # the same build, served


_NO_CUDA_START = r"""
import json, sys
import torch, lora_cache
from lora_cache.placement.layers import checkpoint_module
model = checkpoint_module([sys.argv[1]])
stats = lora_cache.merge(model, [sys.argv[2]], cache_root=sys.argv[3], progress=False)
print(json.dumps({"built": stats.built, "cuda_started": torch.cuda.is_initialized()}))
"""


@needs_cuda
def test_a_merge_on_a_gpu_host_leaves_cuda_unstarted(tmp_path):
    """CUDA's own start costs a process about 140 MiB of anonymous host memory: a merge
    of host weights must not be what starts it."""
    _, adapter = _setup(tmp_path)
    child = run_python(_NO_CUDA_START, str(tmp_path / "base.safetensors"), adapter, str(tmp_path / "cache"))
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report == {"built": 6, "cuda_started": False}, report


@needs_cuda
def test_gpu_resident_weights_merge_in_place_on_their_gpu(tmp_path):
    """The same bytes as host weights summed on the GPU by name (one row block, the same
    addmm), and the weights stay on the GPU."""
    model, adapter = _setup(tmp_path)
    on_gpu = mapped_model(tmp_path / "gpu", dtype=torch.bfloat16).cuda()
    before = {n: p.detach().clone() for n, p in on_gpu.named_parameters()}
    stats = lora_cache.merge(on_gpu, [adapter], enabled=False, progress=False)
    assert stats.layers == 6
    lora_cache.merge(model, [adapter], enabled=False, device="cuda", progress=False)
    for (name, merged), (_, expected) in zip(on_gpu.named_parameters(), model.named_parameters()):
        assert merged.device.type == "cuda", name
        assert torch.equal(merged.cpu(), expected), name
    changed = {n for n, p in on_gpu.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {f"blocks.{i}.attn.to_{w}.weight" for i in range(2) for w in "qkv"}
