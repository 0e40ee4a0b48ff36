"""The layer-by-layer merge through the vault: memory, stats, fallbacks, the command line.

Memory is measured in fresh subprocesses (the kernel's RssAnon, sampled by the peak
tracker from outside), so the test process's own heap does not blur the figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lora_cache
from lora_cache.layers import checkpoint_module
from lora_cache.switch import DISABLE_ENV
from planners.cli import main
from tests.conftest import run_python, write_safetensors
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter

MiB = 1024 * 1024

# ----------------------------------------------------------------- memory, in subprocesses

_MEASURE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
import torch, lora_cache
from hostmem import account
from hostmem.peak import track_peak_anon
from hostmem.procfs import read_status
from lora_cache.layers import checkpoint_module, module_tree
from safetensors.torch import load_file

base, adapter, root, loader = sys.argv[1], sys.argv[2], sys.argv[3] or None, sys.argv[4]
if loader == "readonly":   # hostmem's read-only mapping
    model = checkpoint_module([base])
else:                      # safetensors' own loader: a private, writable mapping of the file
    model = module_tree(load_file(base).items())
before = read_status().rss_anon
with track_peak_anon() as peak:
    stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
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
}))
"""


@pytest.fixture(scope="module")
def file_backed_model(tmp_path_factory):
    """A 64 MiB bf16 checkpoint (8 layers of 8 MiB) and a rank-16 adapter on every layer."""
    folder = tmp_path_factory.mktemp("memory")
    gen = torch.Generator().manual_seed(0)
    layers = {f"blocks.{i}.proj.weight": torch.randn(2048, 2048, generator=gen).to(torch.bfloat16) for i in range(8)}
    base = write_safetensors(folder / "base.safetensors", layers)
    changes = {f"blocks.{i}.proj": lora_change(2048, 2048, 16, i, alpha=8) for i in range(8)}
    adapter = write_adapter(folder / "turbo.safetensors", "comfyui", changes)
    return {"base": base, "adapter": adapter, "folder": folder, "largest_fp32": 2048 * 2048 * 4, "merged": 64 * MiB}


def _measure(model: dict, root: str, loader: str = "readonly") -> dict:
    done = run_python(_MEASURE, model["base"], model["adapter"], root, loader)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cached_merge_stays_one_layer_wide_and_leaves_merged_weights_file_backed(file_backed_model):
    model, root = file_backed_model, str(file_backed_model["folder"] / "cache")
    built = _measure(model, root)
    assert built["stats"]["built"] == 8 and built["stats"]["fallen_back"] == 0
    assert built["growth"] <= 2 * model["largest_fp32"] + 64 * MiB, built
    assert built["kept"] <= 16 * MiB, f"the merge kept {built['kept']} bytes of scratch after it ended"
    assert built["anonymous"] == 0 and built["file_backed"] == model["merged"], built
    hit = _measure(model, root)
    assert hit["stats"]["hit"] == 8 and hit["stats"]["built"] == 0
    assert hit["growth"] <= 2 * model["largest_fp32"] + 64 * MiB, hit
    assert hit["anonymous"] == 0 and hit["file_backed"] == model["merged"], hit


def test_in_place_merge_of_the_same_model_costs_about_twice_the_merged_bytes(file_backed_model):
    """Loaded as servers load it (safetensors' private mapping): snapshot + copied-on-write pages."""
    model = file_backed_model
    in_place = _measure(model, "", loader="private")
    assert in_place["stats"]["in_place"] == 8
    assert 1.9 * model["merged"] <= in_place["growth"] <= 2 * model["merged"] + 2 * model["largest_fp32"] + 64 * MiB
    assert in_place["anonymous"] == model["merged"], in_place
    cached = _measure(model, str(model["folder"] / "private-cache"), loader="private")
    assert cached["stats"]["built"] == 8 and cached["growth"] <= 2 * model["largest_fp32"] + 64 * MiB, cached
    assert cached["anonymous"] == 0 and cached["file_backed"] == model["merged"], cached


def test_in_place_merge_over_a_read_only_mapping_needs_no_snapshot_copy(file_backed_model):
    """The base cannot be written, so it stays intact and is its own snapshot: once the bytes."""
    model = file_backed_model
    in_place = _measure(model, "", loader="readonly")
    assert 0.95 * model["merged"] <= in_place["growth"] <= model["merged"] + 2 * model["largest_fp32"] + 64 * MiB
    assert in_place["anonymous"] == model["merged"], in_place


# ----------------------------------------------------------------- stats and switches


def _setup(tmp_path, dtype=torch.bfloat16):
    model = mapped_model(tmp_path, dtype=dtype)
    changes = {f"blocks.{i}.attn.to_{w}": lora_change(64, 64, 4, i) for i in range(2) for w in "qkv"}
    return model, write_adapter(tmp_path / "a.safetensors", "kohya", changes)


def test_second_start_hits_every_layer_and_reports_stats(tmp_path, capsys):
    model, adapter = _setup(tmp_path)
    first = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=True)
    assert (first.layers, first.built, first.hit) == (6, 6, 0)
    assert first.bytes == 6 * 64 * 64 * 2 and first.bytes_written >= first.bytes and first.seconds > 0
    assert "lora merge" in capsys.readouterr().err  # the progress bar
    lora_cache.unmerge(model)
    second = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    assert (second.built, second.hit, second.cache_key) == (0, 6, first.cache_key)
    data = json.loads(json.dumps(second.to_dict()))
    assert data["hit"] == 6 and data["bytes"] == first.bytes and "rate_bytes_per_s" in data
    assert "6 hit" in str(second) and "KiB" in str(second)


def test_disabling_the_cache_merges_in_place(tmp_path, monkeypatch):
    model, adapter = _setup(tmp_path)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "off", enabled=False, progress=False)
    assert stats.in_place == 6 and not (tmp_path / "off").exists()
    lora_cache.unmerge(model)
    monkeypatch.setenv(DISABLE_ENV, "1")
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "env", progress=False)
    assert stats.in_place == 6 and stats.cache_key is None and not (tmp_path / "env").exists()


def test_a_cache_without_room_falls_back_in_place_with_one_warning(tmp_path):
    model, adapter = _setup(tmp_path)
    reference = lora_cache.merge(model, [adapter], progress=False)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.unmerge(model)
    with pytest.warns(UserWarning, match="needs") as caught:
        stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", max_size="4KiB", progress=False)
    assert len([w for w in caught if "needs" in str(w.message)]) == 1
    assert (stats.fallen_back, stats.built, stats.bytes) == (6, 0, reference.bytes)
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    lora_cache.unmerge(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(lora_cache.CacheBuildError, match="could not store 'blocks.0.attn.to_q.weight'"):
        lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", max_size="4KiB", fallback=False,
                         progress=False)
    assert not lora_cache.is_merged(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_weights_not_mapped_from_a_file_need_base_files(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    base = write_safetensors(tmp_path / "base.safetensors", {k: v.detach() for k, v in model.state_dict().items()})
    adapter = write_adapter(tmp_path / "a.safetensors", "comfyui", {"0": lora_change(64, 64, 4, 1)})
    expected = r"cannot tell which checkpoint 1 weight\(s\) come from \(0.weight\).*base_files="
    with pytest.raises(ValueError, match=expected):
        lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    assert not lora_cache.is_merged(model)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", base_files=[base], progress=False)
    assert stats.built == 1


# ----------------------------------------------------------------- hostmem lora merge


def _hostmem(*args) -> subprocess.CompletedProcess:
    """The real command line, in its own process."""
    return subprocess.run([sys.executable, "-m", "planners.cli", *args], capture_output=True, text=True, timeout=120)


def _config(tmp_path, enabled=True) -> str:
    _setup(tmp_path)
    os.rename(tmp_path / "base.safetensors", tmp_path / "dit.safetensors")
    text = f"""
deployment: lora-test
host: {{limit: 8GiB, reserve: 1GiB}}
workload: {{steps: 4}}
components:
  dit: {{path: dit.safetensors, offload: layerwise, layers: "blocks.{{i}}."}}
lora:
  adapters: [{{path: a.safetensors, strength: 0.8}}]
  cache: {{root: cache, enabled: {str(enabled).lower()}, max_size: 1GiB}}
"""
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return str(path)


def test_hostmem_lora_merge_builds_the_cache_ahead_of_time(tmp_path, capsys):
    config = _config(tmp_path)
    first = _hostmem("lora", "merge", config)
    assert first.returncode == 0, first.stderr
    assert "6 built" in first.stdout and str(tmp_path / "cache") in first.stdout
    assert main(["lora", "merge", config, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["hit"], data["built"], data["component"]) == (6, 0, "dit")
    served = checkpoint_module([str(tmp_path / "dit.safetensors")])  # a server's start, mapped
    stats = lora_cache.merge(served, [(tmp_path / "a.safetensors", 0.8)], cache_root=tmp_path / "cache", progress=False)
    assert (stats.hit, stats.built, stats.cache_key) == (6, 0, data["cache_key"])


def test_hostmem_lora_merge_refuses_a_disabled_cache(tmp_path, capsys, monkeypatch):
    assert main(["lora", "merge", _config(tmp_path, enabled=False)]) == 2
    assert "lora.cache.enabled is false" in capsys.readouterr().err
    monkeypatch.setenv(DISABLE_ENV, "1")
    assert main(["lora", "merge", _config(tmp_path / "x")]) == 2
    assert f"{DISABLE_ENV} is set" in capsys.readouterr().err
