"""A build writes the layers the page cache holds the way measured faster on the machine,
remembered in the root's kernel wisdom; either way the same bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import lora_cache
from hostmem.vault import Vault
from hostmem.vault.durable import TMP_PREFIX
from hostmem.vault.read_ahead import PAGE_CACHE_SHARE, page_cache_room
from hostmem.write_way import WAYS
from lora_cache.kernels import wisdom, write_way as way_module
from lora_cache.kernels.wisdom import FACTS, WISDOM_FILE, Wisdom
from lora_cache.kernels.write_way import MEASURE_FROM, write_way
from tests.conftest import map_into, write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter

MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def _no_way_in_this_process(monkeypatch):
    """Each test's roots alone say the way: the process's own memory of it (every root on
    one filesystem shares its key) is set aside, the kernel timings kept."""
    kept = {key: entry for key, entry in wisdom._MEMORY.items() if "write way" not in key[1]}
    monkeypatch.setattr(wisdom, "_MEMORY", kept)


def _model(folder) -> nn.Module:
    """Four bf16 linear layers of 2 MiB, read-only mappings of a checkpoint, as a server loads them."""
    gen = torch.Generator().manual_seed(5)
    tensors = {f"{i}.weight": torch.randn(1024, 1024, generator=gen).to(torch.bfloat16) for i in range(4)}
    path = write_safetensors(os.path.join(folder, "base.safetensors"), tensors)
    return map_into(nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4))), path)


def _adapter(folder) -> str:
    changes = {str(i): lora_change(1024, 1024, 16, seed=i, alpha=8) for i in range(4)}
    changes = {m: {k: v.to(torch.bfloat16) if k in ("up", "down") else v for k, v in c.items()}
               for m, c in changes.items()}
    return write_adapter(os.path.join(folder, "lora.safetensors"), "kohya", changes)


def _remembered(root) -> dict:
    """The write-way facts of ``root``'s kernel wisdom."""
    with open(os.path.join(root, WISDOM_FILE)) as handle:
        facts = json.load(handle).get(FACTS, {})
    return {key: fact for key, fact in facts.items() if "write way" in key}


def _pages_dirtied() -> int:
    """Pages the kernel has dirtied since boot, all processes (``nr_dirtied`` in /proc/vmstat)."""
    with open("/proc/vmstat") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("nr_dirtied "))


def _remember(root, way: str) -> None:
    """Record ``way`` as the faster on ``root``'s filesystem, as a measurement would."""
    os.makedirs(root, mode=0o700, exist_ok=True)
    with Wisdom(root).recording(FACTS) as record:
        record(way_module._key(os.fspath(root)), lambda: {"faster": way})


@pytest.mark.parametrize("way", WAYS)
def test_a_build_writes_the_way_its_root_remembers_and_the_bytes_do_not_depend_on_it(tmp_path, way):
    root, model, adapter = tmp_path / "cache", _model(tmp_path), _adapter(tmp_path)
    _remember(root, way)
    dirtied = _pages_dirtied()
    stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    assert stats.built == 4 and stats.write_way == way
    if way == "buffered":  # every merged page went through the page cache (O_DIRECT dirties none of them)
        assert _pages_dirtied() - dirtied >= stats.bytes // 4096
    built = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.unmerge(model)
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    assert all(torch.equal(built[n], p) for n, p in model.named_parameters())
    lora_cache.unmerge(model)
    hit = lora_cache.merge(model, [adapter], cache_root=root, progress=False)  # sealed and verified as ever
    assert hit.hit == 4 and hit.write_way is None
    assert all(torch.equal(built[n], p) for n, p in model.named_parameters())


def test_a_small_build_writes_around_the_page_cache_without_measuring(tmp_path):
    root, model = tmp_path / "cache", _model(tmp_path)
    stats = lora_cache.merge(model, [_adapter(tmp_path)], cache_root=root, progress=False)
    assert stats.built == 4 and stats.write_way == "direct"
    assert not os.path.exists(root / WISDOM_FILE) or _remembered(root) == {}


def test_a_large_build_measures_the_ways_once_on_its_root_and_remembers_the_faster(tmp_path, monkeypatch):
    if PAGE_CACHE_SHARE * page_cache_room() < MEASURE_FROM:
        pytest.skip("the page cache has no room for a build large enough to measure the ways")
    monkeypatch.setattr(way_module, "TRIAL_BYTES", 2 * MiB)
    root = tmp_path / "cache"
    os.makedirs(root, mode=0o700)
    way = write_way(root, 64 << 30)
    (fact,) = _remembered(root).values()
    assert way == fact["faster"] == min(WAYS, key=fact["seconds_per_gib"].get)
    assert fact["trial_bytes"] == 2 * MiB
    assert set(os.listdir(root)) <= {WISDOM_FILE, WISDOM_FILE + ".lock"}  # the trial files gone

    def measured_again(*_):
        raise AssertionError("measured again")

    monkeypatch.setattr(way_module, "measure", measured_again)
    assert write_way(root, 64 << 30) == way  # remembered


def test_a_trial_left_by_a_measurer_killed_midway_is_swept_by_the_next_start(tmp_path):
    root = tmp_path / "cache"
    os.makedirs(root, mode=0o700)
    code = "import sys; from hostmem.write_way import measure; measure(sys.argv[1], 256 << 20)"
    child = subprocess.Popen([sys.executable, "-c", code, str(root)])
    try:
        deadline = time.monotonic() + 60
        while not (left := [n for n in os.listdir(root) if n.startswith(TMP_PREFIX)]) and time.monotonic() < deadline:
            assert child.poll() is None, "the trial ended before it was seen"
            time.sleep(0.005)
        assert left, "no trial file appeared"
    finally:
        child.kill()
        child.wait()
    assert [n for n in os.listdir(root) if n.startswith(TMP_PREFIX)]  # the kill left it behind
    Vault(root)  # a start on the root sweeps what dead writers left
    assert not [n for n in os.listdir(root) if n.startswith(TMP_PREFIX)]
