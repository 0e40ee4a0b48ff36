"""What a merge costs in host memory: cached, one layer wide and file-backed; in place, the
merged bytes.

Memory is measured in fresh subprocesses (the kernel's RssAnon, sampled by the peak
tracker from outside), so the test process's own heap does not blur the figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_python, write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

MiB = 1024 * 1024

# ----------------------------------------------------------------- memory, in subprocesses

_MEASURE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, lora_cache
from hostmem import account
from hostmem.peak import track_peak_anon
from hostmem.procfs import read_status
from lora_cache.placement.layers import checkpoint_module, module_tree
from safetensors import safe_open

base, adapter, root, loader = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
if loader == "readonly":   # hostmem's read-only mapping
    model = checkpoint_module([base])
else:                      # safetensors' own loader: a private, writable mapping of the file
    with safe_open(base, framework="pt") as handle:
        model = module_tree([(name, handle.get_tensor(name)) for name in handle.keys()])
# the kernels timed first (into the root, or this process's memory), as once per machine: the
# timing's bf16 addmm leaves the math library's own buffers (14 MiB on AVX-512 without BF16)
from types import SimpleNamespace
from lora_cache.kernels import plan_for_targets
from lora_cache.kernels.workers import worker_count
from lora_cache.compute.merge_math import BF16_ADDMM, scratch_bytes
from lora_cache.orchestrate import plan_targets
targets = plan_targets(model, [adapter])[0]
cpu, largest = torch.device("cpu"), max(targets, key=lambda t: t.nbytes)
kernel = plan_for_targets(targets, "cpu", root).kernel_for(tuple(largest.current.shape), largest.current.dtype,
                                                           largest.deltas, cpu)
scratch = 0 if kernel == BF16_ADDMM else scratch_bytes(tuple(largest.current.shape), cpu,
                                                       SimpleNamespace(threads=worker_count()))
before = read_status().rss_anon
with track_peak_anon() as peak:
    stats = lora_cache.merge(model, [adapter], cache_root=root, enabled=root is not None, progress=False)
after = read_status().rss_anon
merged = {n: p for n, p in model.named_parameters() if n.endswith("weight")}
for p in merged.values():
    p.sum()  # fault every page in, reading only
ledger = account(model).components["model"].parameters
print(json.dumps({
    "growth": peak.growth_bytes, "kept": after - before, "stats": stats.to_dict(),
    "anonymous": sum(ledger[n].residency.anonymous for n in merged),
    "file_backed": sum(ledger[n].residency.file_backed for n in merged),
    "merged_bytes": sum(p.nbytes for p in merged.values()),
    "kernel": kernel, "scratch": scratch, "workers": worker_count(),
}))
"""


WORKER_OWN = 5 * MiB  # a summing worker's stack and the math library's buffers for it (see below)
LAYERS, ROWS, COLS = 16, 2048, 4096  # 16 bf16 layers of 16 MiB: 256 MiB merged


@pytest.fixture(scope="module")
def file_backed_model(tmp_path_factory):
    """A 256 MiB bf16 checkpoint (16 layers of 16 MiB) and a rank-16 adapter on every layer.

    Large enough that the cached merge's bound (two fp32 layers + 64 MiB = 128 MiB) is
    half of what the cheapest in-place merge costs (the merged bytes), so the bound tells
    the two apart.
    """
    folder = tmp_path_factory.mktemp("memory")
    gen = torch.Generator().manual_seed(0)
    layers = {
        f"blocks.{i}.proj.weight": torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16) for i in range(LAYERS)
    }
    base = write_safetensors(folder / "base.safetensors", layers)
    del layers
    changes = {f"blocks.{i}.proj": lora_change(ROWS, COLS, 16, i, alpha=8) for i in range(LAYERS)}
    adapter = write_adapter(folder / "turbo.safetensors", "comfyui", changes)
    in_bf16 = {m: {k: v.to(torch.bfloat16) for k, v in change.items()} for m, change in changes.items()}
    adapter_bf16 = write_adapter(folder / "turbo-bf16.safetensors", "comfyui", in_bf16)
    return {"base": base, "adapter": adapter, "adapter_bf16": adapter_bf16, "folder": folder,
            "largest_fp32": ROWS * COLS * 4, "merged": 256 * MiB}


def cached_bound(model: dict) -> int:
    """The most a cached merge may grow anonymous memory by: two fp32 layers + 64 MiB."""
    return 2 * model["largest_fp32"] + 64 * MiB


def _measure(model: dict, root: str, loader: str = "readonly", adapter: str = "adapter") -> dict:
    done = run_python(_MEASURE, model["base"], model[adapter], root, loader)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("adapter", ["adapter", "adapter_bf16"])  # fp32 factors sum in fp32 scratch, bf16 in one pass
def test_cached_merge_stays_one_layer_wide_and_leaves_merged_weights_file_backed(file_backed_model, adapter):
    model, root = file_backed_model, str(file_backed_model["folder"] / f"cache-{adapter}")
    assert cached_bound(model) <= model["merged"] / 2  # an in-place merge (>= the merged bytes) cannot pass it
    built = _measure(model, root, adapter=adapter)
    assert built["stats"]["built"] == LAYERS and built["stats"]["fallen_back"] == 0
    assert built["growth"] <= cached_bound(model), built
    assert built["kept"] <= 16 * MiB, f"the merge kept {built['kept']} bytes of scratch after it ended"
    assert built["anonymous"] == 0 and built["file_backed"] == model["merged"], built
    hit = _measure(model, root, adapter=adapter)
    assert hit["stats"]["hit"] == LAYERS and hit["stats"]["built"] == 0
    assert hit["growth"] <= cached_bound(model), hit
    assert hit["anonymous"] == 0 and hit["file_backed"] == model["merged"], hit


def test_in_place_merge_of_the_same_model_costs_the_merged_bytes_and_one_layer_at_most(file_backed_model):
    """Loaded as servers load it (safetensors' private mapping): each layer's merged weight is a
    new tensor (the file's pages are never copied on write), so the merged bytes are the
    cost, as with peft's merge, plus the chosen kernel's fp32 blocks in flight (at most one
    layer's worth) and each summing worker's own: its stack and the math library's
    per-thread buffers (34 MiB over the merged bytes with 8 workers on a 16-core host with
    AMX; a second layer held would be 16 MiB more per layer)."""
    model = file_backed_model
    in_place = _measure(model, "", loader="private")
    assert in_place["stats"]["in_place"] == LAYERS
    assert in_place["scratch"] <= model["largest_fp32"], in_place  # at most a layer's worth of fp32 blocks
    bound = model["merged"] + in_place["scratch"] + in_place["workers"] * WORKER_OWN
    assert 0.95 * model["merged"] <= in_place["growth"] <= bound, (
        f"in place grew {in_place['growth'] / MiB:.1f} MiB: over the merged {model['merged'] / MiB:.0f} MiB, the "
        f"{in_place['kernel']} kernel's {in_place['scratch'] / MiB:.0f} MiB of blocks and {in_place['workers']} "
        f"workers' own {WORKER_OWN / MiB:.0f} MiB each")
    assert in_place["growth"] > 1.5 * cached_bound(model)  # the bound the cached merge meets is far below
    assert in_place["anonymous"] == model["merged"], in_place
    cached = _measure(model, str(model["folder"] / "private-cache"), loader="private")
    assert cached["stats"]["built"] == LAYERS and cached["growth"] <= cached_bound(model), cached
    assert cached["anonymous"] == 0 and cached["file_backed"] == model["merged"], cached


def test_in_place_merge_over_a_read_only_mapping_needs_no_snapshot_copy(file_backed_model):
    """The base cannot be written, so it stays intact and is its own snapshot: once the bytes."""
    model = file_backed_model
    in_place = _measure(model, "", loader="readonly")
    assert 0.95 * model["merged"] <= in_place["growth"] <= model["merged"] + cached_bound(model)
    assert in_place["growth"] > 1.5 * cached_bound(model)  # even the cheapest in-place merge fails the cached bound
    assert in_place["anonymous"] == model["merged"], in_place
