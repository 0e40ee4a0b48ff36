"""The cache is on unless asked off: the default root, the switches, and ``lora.cache.roots``."""

from __future__ import annotations

import os

import pytest

from planners.config import ConfigError, load_config
from tests.faults.world import LAYERS, assert_same, make_world, reference, start


def test_merge_without_a_root_uses_the_default_root(tmp_path, monkeypatch):
    world = make_world(tmp_path)
    monkeypatch.setenv("HOSTMEM_CACHE_ROOT", world.path("default"))
    served, stats = start(world.base, world.adapter, None)
    assert_same(served, reference(world.base, world.adapter))
    assert stats.built == LAYERS and stats.cache_root == world.path("default") and stats.cache_off is None
    assert os.path.isdir(world.path("default", "lora_merge_cache", stats.cache_key))


@pytest.mark.parametrize("how", ["enabled=False", "HOSTMEM_DISABLE_LORA_MERGE_CACHE=1"])
def test_merging_in_place_is_asked_for_and_the_stats_say_so(tmp_path, monkeypatch, how):
    import lora_cache
    from lora_cache.placement.layers import checkpoint_module

    world = make_world(tmp_path)
    monkeypatch.setenv("HOSTMEM_CACHE_ROOT", world.path("default"))
    if how != "enabled=False":
        monkeypatch.setenv("HOSTMEM_DISABLE_LORA_MERGE_CACHE", "1")
    model = checkpoint_module([world.base])
    stats = lora_cache.merge(model, [world.adapter], enabled=how != "enabled=False", progress=False)
    assert (stats.in_place, stats.cache_key, stats.cache_root) == (LAYERS, None, None)
    assert how in stats.cache_off and how in str(stats) and stats.to_dict()["cache_off"] == stats.cache_off
    assert not os.path.exists(world.path("default"))


def _config(tmp_path, cache: str) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(
        "deployment: roots\nhost: {limit: 8GiB, reserve: 1GiB}\nworkload: {steps: 4}\n"
        "components:\n  dit: {size: 1GiB, layers: 4, offload: layerwise}\n"
        f"lora:\n  adapters: [{{path: a.safetensors}}]\n  cache: {cache}\n"
    )
    return str(path)


def test_cache_roots_is_an_ordered_list_and_root_a_list_of_one(tmp_path):
    config = load_config(_config(tmp_path, "{roots: [/image/cache, local]}"))
    assert config.lora.cache.roots == ("/image/cache", str(tmp_path / "local"))
    assert config.lora.cache.root == "/image/cache"
    config = load_config(_config(tmp_path, "{root: here}"))
    assert config.lora.cache.roots == (str(tmp_path / "here"),)
    with pytest.raises(ConfigError, match="not both"):
        load_config(_config(tmp_path, "{root: here, roots: [there]}"))
    with pytest.raises(ConfigError, match="non-empty list"):
        load_config(_config(tmp_path, "{roots: []}"))
