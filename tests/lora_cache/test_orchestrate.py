"""The layer-by-layer merge through the vault: stats, fallbacks, the collector, the command line.

What a merge costs in memory is in ``test_merge_memory``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import lora_cache
from lora_cache.adapters import as_adapter, read_adapter
from lora_cache.placement.layers import AddressSpace, checkpoint_module, module_tree
from lora_cache.orchestrate import MERGE_POLICY, combination_key, plan_targets
from lora_cache.settings import DISABLE_ENV
from hostmem.vault import Vault, VaultSession
from planners.cli import main
from tests.conftest import run_python, write_safetensors
from tests.fresh_fork import CLI, TORCH
from tests.lora_cache.test_adapters import lora_change, mapped_model, write_adapter

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


def test_a_build_that_mixes_one_pass_and_fp32_layers_writes_what_an_in_place_merge_computes(tmp_path, monkeypatch):
    """bf16 layers with a bf16 LoRA sum straight into the output buffer, the ones that also
    carry a full delta sum in the fp32 scratch first and are cast into it: while each layer
    is written from the buffer, the next one is summed into it, and no block may overwrite
    bytes not yet written. Each put is held back so that the next layer's blocks surely
    wait on it."""
    gen = torch.Generator().manual_seed(7)
    names = [f"blocks.{i}.proj" for i in range(7)]
    base = write_safetensors(tmp_path / "base.safetensors", {
        f"{n}.weight": torch.randn(512, 256, generator=gen).to(torch.bfloat16) for n in names})
    changes = {n: {k: v.to(torch.bfloat16) for k, v in lora_change(512, 256, 8, i, alpha=4).items()}
               for i, n in enumerate(names)}
    # These take the fp32 path: 1 and 3 after a one-pass layer, 4 after an fp32 one.
    for i in (1, 3, 4):
        changes[names[i]]["diff"] = torch.randn(512, 256, generator=gen).to(torch.bfloat16) * 0.01
    adapter = write_adapter(tmp_path / "mixed.safetensors", "comfyui", changes)
    put = VaultSession.put

    def slow_put(self, *args):
        time.sleep(0.05)
        return put(self, *args)

    monkeypatch.setattr(VaultSession, "put", slow_put)
    model = checkpoint_module([base])
    built = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    assert (built.built, built.fallen_back) == (7, 0)
    cached = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.unmerge(model)
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    for name, weight in model.named_parameters():
        assert torch.equal(weight, cached[name]), name


_FAILING_MID_BUILD = r"""
import os, resource, signal, sys, warnings
import torch, lora_cache
from lora_cache.placement.layers import checkpoint_module
base, adapter, root = sys.argv[1:4]
model = checkpoint_module([base])
lora_cache.merge(model, [adapter], progress=False, enabled=False)  # in place: the reference
expected = {n: p.detach().clone() for n, p in model.named_parameters()}
lora_cache.unmerge(model)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    stats = lora_cache.merge(model, [adapter], cache_root=root, enabled=root is not None, progress=False)
same = all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
folder = os.path.join(root, "lora_merge_cache", stats.cache_key)
print(stats.built, stats.fallen_back, same, len([w for w in caught if "in place" in str(w.message)]))
print(sorted(f for f in os.listdir(folder) if f.startswith(".tmp-")))
"""


def test_a_write_failing_mid_build_falls_back_from_that_layer_on_with_the_same_bytes(tmp_path):
    """The fourth layer (2 MiB) cannot be written under a 1 MiB RLIMIT_FSIZE: the three before
    it are built, it and the two after it merge in place, recomputed in the output buffer
    the failed put was streaming from, and every weight equals the in-place merge's."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(256, 256)] * 3 + [(1024, 1024)] + [(256, 256)] * 2
    names = [f"blocks.{i}.proj" for i in range(len(shapes))]
    base = write_safetensors(tmp_path / "base.safetensors", {
        f"{n}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16) for n, shape in zip(names, shapes)})
    changes = {n: {k: v.to(torch.bfloat16) for k, v in lora_change(*shape, 8, i, alpha=4).items()}
               for i, (n, shape) in enumerate(zip(names, shapes))}
    changes[names[4]]["diff"] = torch.randn(shapes[4], generator=gen).to(torch.bfloat16) * 0.01  # an fp32 layer
    adapter = write_adapter(tmp_path / "a.safetensors", "comfyui", changes)
    done = run_python(_FAILING_MID_BUILD, base, adapter, str(tmp_path / "cache"), forked_from=TORCH)
    assert done.returncode == 0, done.stderr
    counts, leftovers = done.stdout.splitlines()
    assert counts == "3 3 True 1" and leftovers == "[]"


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
    reference = lora_cache.merge(model, [adapter], progress=False, enabled=False)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora_cache.unmerge(model)
    with pytest.warns(UserWarning, match="needs") as caught:
        stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", max_size="4KiB", progress=False)
    (warning,) = [str(w.message) for w in caught if "needs" in str(w.message)]
    assert warning.startswith("no room for the LoRA merge cache") and "hostmem cache prune" in warning
    assert warning.endswith("Merging in place instead.")
    assert (stats.fallen_back, stats.built, stats.bytes) == (6, 0, reference.bytes)
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    lora_cache.unmerge(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(lora_cache.CacheBuildError, match="could not store 'blocks.0.attn.to_q.weight'") as refused:
        lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", max_size="4KiB", fallback=False,
                         progress=False)
    message = str(refused.value)
    assert "no room for the LoRA merge cache" in message and "needs 72.0 KiB" in message
    assert "Nothing was merged in place" in message and "merging in place instead" not in message.lower()
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


def test_the_compute_device_is_part_of_the_key(tmp_path):
    """A GPU's addmm may round differently from the CPU's: a cache built on one never serves the other."""
    model, adapter = _setup(tmp_path)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", device="cpu", progress=False)
    manifest = json.loads((tmp_path / "cache" / "lora_merge_cache" / stats.cache_key / "manifest.json").read_text())
    assert manifest["inputs"]["merge_policy"] == f"{MERGE_POLICY}@cpu"
    vault, specs = Vault(tmp_path / "cache"), [as_adapter(adapter)]
    files, shards = [read_adapter(adapter)], [str(tmp_path / "base.safetensors")]
    planned = {t.name: t.deltas for t in plan_targets(model, specs)[0]}
    on_cpu = combination_key(vault, files, specs, shards, {torch.bfloat16}, "cpu", planned=planned)
    assert on_cpu.hex == stats.cache_key
    assert combination_key(vault, files, specs, shards, {torch.bfloat16}, "cuda", planned=planned).hex != on_cpu.hex


def test_a_build_gives_back_torchs_thread_count_also_when_it_fails(tmp_path):
    """The build's workers run torch single-threaded; the count is process-wide, so it comes back."""
    model, adapter = _setup(tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", device="cpu", progress=False)
        assert stats.built == 6 and torch.get_num_threads() == 2
        lora_cache.unmerge(model)
        with pytest.raises(lora_cache.CacheBuildError):
            lora_cache.merge(model, [adapter], cache_root=tmp_path / "full", max_size="4KiB", fallback=False,
                             device="cpu", progress=False)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def _collections_inside(merge):
    """Yield a list that gets, per cyclic collection while inside, whether it ran inside
    ``merge``'s body (on any thread), with the collector told to run at every allocation."""
    import gc

    body = getattr(merge, "__wrapped__", merge).__code__
    seen: list[bool] = []

    def count(phase, info):
        if phase == "start":
            frame = sys._getframe()
            while frame is not None and frame.f_code is not body:
                frame = frame.f_back
            seen.append(frame is not None)

    thresholds = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1, 1, 1)
    try:
        yield seen
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(count)


def test_no_cyclic_collection_runs_inside_a_merge_and_the_collector_is_left_as_found(tmp_path):
    """A full collection holds the interpreter lock for tens of milliseconds (and, in a rank of
    a shared build, holds up the others at the next meeting): none runs inside a merge, even
    with the collector told to run at every allocation, and it runs again once the merge is done."""
    import gc

    model, adapter = _setup(tmp_path)
    merge = lora_cache.merge  # imported here: importing it is not the merge
    try:
        with _collections_inside(merge) as seen:
            stats = merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
            during, before_after = sum(seen), len(seen)
            junk = [[i] for i in range(1000)]  # allocations after the merge: the collector is back
            after = len(seen) - before_after
            del junk
            lora_cache.unmerge(model)
            gc.disable()
            merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
            left_off = gc.isenabled()
    finally:
        gc.enable()
    assert stats.built == 6 and during == 0, f"{during} collections ran inside the merge"
    assert after > 0 and left_off is False


def test_a_merge_off_the_main_thread_leaves_the_collector_running(tmp_path):
    """A switch's background build merges on a thread of its own while the server serves:
    the collector is the whole process's, so it keeps running there."""
    import gc
    import threading

    model, adapter = _setup(tmp_path)
    merge = lora_cache.merge
    results = []
    thread = threading.Thread(target=lambda: results.append(
        merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)))
    with _collections_inside(merge) as inside:
        thread.start()
        thread.join()
    assert results and results[0].built == 6 and gc.isenabled()
    assert sum(inside) > 0, "no collection ran inside a merge on another thread"


def test_the_address_space_reads_maps_not_smaps(tmp_path):
    """Paths and permissions are all a merge asks; smaps would walk every resident page for counts."""
    model, _ = _setup(tmp_path)
    weight = model.blocks[0].attn.to_q.weight
    float(weight.float().sum())  # its pages are resident now: smaps would count them
    area = AddressSpace().area_of(weight)
    assert area.path == os.path.realpath(tmp_path / "base.safetensors") and "w" not in area.perms
    assert (area.rss, area.vm_flags) == (0, frozenset())  # maps carries neither Rss nor VmFlags


# ----------------------------------------------------------------- hostmem lora merge


def _hostmem(*args) -> subprocess.CompletedProcess:
    """The real command line, in its own process."""
    return run_python(CLI, *args, timeout=120, forked_from=TORCH)


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


def _sharded_config(tmp_path) -> tuple[str, list[str]]:
    """A checkpoint folder of two shards, the second holding no LoRA target, and its config."""
    config = _config(tmp_path)
    folder = tmp_path / "dit"
    folder.mkdir()
    os.rename(tmp_path / "dit.safetensors", folder / "dit-00001-of-00002.safetensors")
    write_safetensors(folder / "dit-00002-of-00002.safetensors", {"head.proj.weight": torch.ones(16, 64)})
    with open(config) as handle:
        text = handle.read().replace("path: dit.safetensors", "path: dit")
    with open(config, "w") as handle:
        handle.write(text)
    return config, sorted(str(p) for p in folder.iterdir())


_SERVER_START = """
    import json, sys
    import lora_cache
    from lora_cache.placement.layers import checkpoint_module
    shards, adapter, root = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    model = checkpoint_module(shards)  # the whole checkpoint mapped, as a server loads it; no base_files
    print(json.dumps(lora_cache.merge(model, [(adapter, 0.8)], cache_root=root, progress=False).to_dict()))
"""


def test_a_cache_built_ahead_of_time_is_hit_by_servers_when_a_shard_holds_no_target(tmp_path):
    """The key covers the shards that hold the targets, whichever way the merge learns of them."""
    config, shards = _sharded_config(tmp_path)
    built = _hostmem("lora", "merge", config, "--json")
    assert built.returncode == 0, built.stderr
    built = json.loads(built.stdout)
    assert (built["built"], built["hit"]) == (6, 0)
    served = run_python(_SERVER_START, ",".join(shards), str(tmp_path / "a.safetensors"), str(tmp_path / "cache"), forked_from=TORCH)
    assert served.returncode == 0, served.stderr
    served = json.loads(served.stdout.strip().splitlines()[-1])
    assert (served["hit"], served["built"], served["cache_key"]) == (6, 0, built["cache_key"])
    # weights copied onto the heap: base_files lists every shard, and is narrowed to the one holding them
    copied = module_tree((name, tensor.clone()) for name, tensor in checkpoint_module(shards).named_parameters())
    stats = lora_cache.merge(copied, [(tmp_path / "a.safetensors", 0.8)], cache_root=tmp_path / "cache",
                             base_files=shards, progress=False)
    assert (stats.hit, stats.built, stats.cache_key) == (6, 0, built["cache_key"])


def test_hostmem_lora_merge_without_room_says_what_it_needed_and_merges_nothing(tmp_path):
    config = _config(tmp_path)
    with open(config) as handle:
        text = handle.read().replace("max_size: 1GiB", "max_size: 4KiB")
    with open(config, "w") as handle:
        handle.write(text)
    done = _hostmem("lora", "merge", config)
    assert done.returncode == 1
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("hostmem: error: the LoRA merge cache could not store ") and "needs 72.0 KiB" in error
    assert "max_size 4.0 KiB" in error and "Nothing was merged in place" in error
    assert "in place instead" not in error
