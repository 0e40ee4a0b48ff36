"""The planner's provider: what the cached merge offers, sized from real files."""

from __future__ import annotations

import os

import pytest
import torch

import lora_cache
from lora_cache.placement.layers import checkpoint_module
from lora_cache.settings import DISABLE_ENV
from lora_cache.provider import LoraCacheProvider, target_layers
from tests.conftest import run_python, write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

GB = 1000**3
OFFER_FIELDS = ("provider", "component", "anonymous_bytes", "disk_bytes", "one_time_s", "note")


def test_offer_is_the_in_place_cost_merged_layers_plus_snapshot():
    provider = LoraCacheProvider("dit", 38 * GB, layers=208, largest_layer_bytes=64 << 20,
                                 largest_layer_numel=32 << 20, build_rate=1 * GB)
    offer = provider.offer()
    assert all(hasattr(offer, name) for name in OFFER_FIELDS)
    assert (offer.provider, offer.component) == ("lora_cache", "dit")
    assert offer.anonymous_bytes == 76 * GB
    assert 38 * GB < offer.disk_bytes <= 38 * GB + 208 * 8192
    assert offer.one_time_s == pytest.approx(38.0)
    assert offer.transient_bytes == (32 << 20) * 4 + (64 << 20)
    assert "70.8 GiB anonymous" in offer.note and "35.4 GiB" in offer.note


def test_the_planner_takes_the_offer():
    from planners.providers import Provider, collect_offers

    provider = LoraCacheProvider("dit", 38 * GB, layers=208)
    assert isinstance(provider, Provider)
    (record,) = collect_offers([provider], {"dit", "text_encoder"})
    assert (record.provider, record.component, record.anonymous_bytes) == ("lora_cache", "dit", 76 * GB)


def test_a_built_cache_costs_no_disk_and_no_time():
    offer = LoraCacheProvider("dit", 38 * GB, layers=208, cached=True).offer()
    assert (offer.anonymous_bytes, offer.disk_bytes, offer.one_time_s) == (76 * GB, 0, 0.0)
    assert "already built" in offer.note


def test_no_offer_when_the_cache_is_off_or_there_is_nothing_to_merge(monkeypatch):
    assert LoraCacheProvider("dit", 38 * GB, enabled=False).offer() is None
    assert LoraCacheProvider("dit", 0).offer() is None
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert LoraCacheProvider("dit", 38 * GB).offer() is None
    with pytest.raises(ValueError, match="must not be negative"):
        LoraCacheProvider("dit", -1)


def _checkpoint(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {f"blocks.{i}.attn.{w}.weight": torch.randn(128, 64, generator=gen).to(torch.bfloat16)
               for i in range(3) for w in ("to_q", "to_k")}
    tensors.update({f"blocks.{i}.norm.weight": torch.ones(64) for i in range(3)})
    shards = [write_safetensors(tmp_path / "dit-1.safetensors", dict(list(tensors.items())[:4])),
              write_safetensors(tmp_path / "dit-2.safetensors", dict(list(tensors.items())[4:]))]
    changes = {f"blocks.{i}.attn.to_q": lora_change(128, 64, 4, i) for i in range(3)}
    return shards, write_adapter(tmp_path / "a.safetensors", "kohya", changes)


def test_from_checkpoint_sizes_the_targets_from_headers_and_sees_a_built_cache(tmp_path):
    shards, adapter = _checkpoint(tmp_path)
    root = tmp_path / "cache"
    found = target_layers(shards, [adapter], root)
    assert found.names == ("blocks.0.attn.to_q.weight", "blocks.1.attn.to_q.weight", "blocks.2.attn.to_q.weight")
    assert (found.nbytes, found.largest_numel, found.cached) == (3 * 128 * 64 * 2, 128 * 64, False)
    before = LoraCacheProvider.from_checkpoint("dit", shards, [adapter], root).offer()
    stats = lora_cache.merge(checkpoint_module(shards), [adapter], cache_root=root, base_files=shards, progress=False)
    assert stats.bytes == found.nbytes and stats.built == 3
    folder = root / "lora_merge_cache" / stats.cache_key
    layer_files = [e for e in os.scandir(folder) if e.name.endswith(".safetensors")]
    assert before.disk_bytes == sum(e.stat().st_size for e in layer_files)
    after = target_layers(shards, [adapter], root)
    assert after.cached and after.cache_key == stats.cache_key
    assert LoraCacheProvider.from_checkpoint("dit", shards, [adapter], root).offer().disk_bytes == 0
    assert not target_layers(shards, [(adapter, 0.5)], root).cached  # another strength, another key
    # a start's roots in order, the combination in the second: cached, as the start finds it there
    (tmp_path / "own").mkdir()
    listed = target_layers(shards, [adapter], [tmp_path / "own", root])
    assert listed.cached and listed.cache_key == stats.cache_key


def test_lora_cache_imports_nothing_from_planners():
    done = run_python(
        """
        import sys, lora_cache, lora_cache.provider, hostmem.vault
        print(sorted(m for m in sys.modules if m == "planners" or m.startswith("planners.")))
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_offer_counts_layer_files_as_the_vault_writes_them():
    import torch

    from lora_cache.provider import LAYER_FILE_OVERHEAD
    from hostmem.vault import layer_file_bytes

    assert layer_file_bytes((0,), torch.uint8) == LAYER_FILE_OVERHEAD
    assert layer_file_bytes((1024, 64), torch.bfloat16) == LAYER_FILE_OVERHEAD + 1024 * 64 * 2
