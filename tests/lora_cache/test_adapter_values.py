"""An adapter's values are read where they are consumed, never on a start that hits every layer.

The NaN/Inf check reads every value of an adapter file; it runs before the first layer is
computed (built, merged in place, applied at run time), so a start whose every layer is
in the cache leaves the adapter's pages on disk. Whether they were read is asked of the
kernel (mincore) after their pages were dropped from the page cache.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import lora_cache
from lora_cache import AdapterError
from lora_cache.adapters import forget_checked
from lora_cache.placement.layers import checkpoint_module
from lora_cache.placement.runtime_lora import CHILD, apply_runtime
from lora_cache.orchestrate import plan_targets
from tests.conftest import drop_page_cache, run_python, write_safetensors
from tests.fresh_fork import TORCH
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter
from tests.page_cache import cached_pages

MiB = 1024 * 1024

_START = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import lora_cache
from lora_cache.placement.layers import checkpoint_module

base, adapter, root = sys.argv[1:4]
stats = lora_cache.merge(checkpoint_module([base]), [adapter], cache_root=root, progress=False)
print(json.dumps({"hit": stats.hit, "built": stats.built}))
"""


def _resident_bytes(path: str) -> int:
    return sum(cached_pages(path)) * 4096


def _start(base: str, adapter: str, root: str) -> dict:
    done = run_python(_START, base, adapter, root, forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_start_that_hits_every_layer_reads_no_adapter_value(tmp_path):
    """8 layers, a 12 MiB adapter without alphas: the hit start reads its header only
    (plus the kernel's readahead of it), where the check would read all 12 MiB."""
    gen = torch.Generator().manual_seed(0)
    base = write_safetensors(tmp_path / "base.safetensors",
                             {f"blocks.{i}.proj.weight": torch.randn(512, 1024, generator=gen) for i in range(8)})
    changes = {f"blocks.{i}.proj": lora_change(512, 1024, 256, i) for i in range(8)}
    adapter = write_adapter(tmp_path / "a.safetensors", "comfyui", changes)
    root = str(tmp_path / "cache")
    assert _start(base, adapter, root) == {"hit": 0, "built": 8}
    drop_page_cache(adapter)
    assert _resident_bytes(adapter) < 1 * MiB  # the probe sees the drop
    assert _start(base, adapter, root) == {"hit": 8, "built": 0}
    assert _resident_bytes(adapter) < 6 * MiB, "the hit start read the adapter's values back"


def _nan_adapter(tmp_path) -> str:
    changes = {f"blocks.{i}.attn.to_{w}": lora_change(64, 64, 4, i) for i in range(2) for w in "qk"}
    changes["blocks.1.attn.to_k"]["down"][2, 5] = math.nan
    return write_adapter(tmp_path / "nan.safetensors", "kohya", changes)


_NAMED = r"nan.safetensors: 'lora_unet_blocks_1_attn_to_k.lora_down.weight' holds 1 NaN or infinite value\(s\) of 256"


@pytest.mark.parametrize("enabled", [True, False], ids=["cached", "in-place"])
def test_a_nan_in_an_adapter_is_refused_before_any_weight_changes(tmp_path, enabled):
    forget_checked()
    model = mapped_model(tmp_path)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    adapter = _nan_adapter(tmp_path)
    plan_targets(model, [adapter])  # reading it does not read its values: no refusal yet
    with pytest.raises(AdapterError, match=_NAMED):
        lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", enabled=enabled, progress=False)
    for name, param in model.named_parameters():
        assert param is before[name][0] and torch.equal(param, before[name][1]), name
    assert not lora_cache.is_merged(model)
    layer_files = list((tmp_path / "cache").rglob("*.safetensors")) if enabled else []
    assert not layer_files


def test_a_nan_in_an_adapter_is_refused_before_anything_is_applied_at_run_time(tmp_path):
    forget_checked()
    model = mapped_model(tmp_path)
    targets, _ = plan_targets(model, [_nan_adapter(tmp_path)])
    with pytest.raises(AdapterError, match=_NAMED):
        apply_runtime(targets)
    assert not any(CHILD in dict(m.named_children()) for m in model.modules())


def test_an_adapter_named_through_a_link_keys_as_its_own_file_does(tmp_path):
    """The hub's snapshots name files through links into its blobs: the combination is the
    file's, so a start through the link and one by the file's own path share a key (the
    second hits every layer) and give the same weights. Each delta's source is resolved
    once a file, not once a layer."""
    gen = torch.Generator().manual_seed(1)
    base = write_safetensors(tmp_path / "base.safetensors",
                             {f"blocks.{i}.proj.weight": torch.randn(64, 128, generator=gen) for i in range(4)})
    adapter = write_adapter(tmp_path / "blob.safetensors", "comfyui",
                            {f"blocks.{i}.proj": lora_change(64, 128, 4, i) for i in range(4)})
    (tmp_path / "snapshots").mkdir()
    link = tmp_path / "snapshots" / "adapter.safetensors"
    os.symlink(adapter, link)
    root = tmp_path / "cache"
    first = checkpoint_module([base])
    stats = lora_cache.merge(first, [str(link)], cache_root=root, progress=False)
    assert (stats.hit, stats.built) == (0, 4)
    second = checkpoint_module([base])
    stats = lora_cache.merge(second, [adapter], cache_root=root, progress=False)
    assert (stats.hit, stats.built) == (4, 0)
    for (name, built), (_, hit) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(built, hit), name
