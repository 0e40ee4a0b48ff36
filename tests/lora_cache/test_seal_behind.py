"""A build written through the page cache is served at once and sealed behind the start:
the weights right from the first call, the combination durable, named and a hit once the
seal is done, whoever waits for it (the process at exit, ``wait_sealed``, a second start)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import torch
from torch import nn

import lora_cache
from hostmem.vault import Vault, wait_sealed
from hostmem.vault.durable import TMP_PREFIX
from hostmem.vault.manifest import MANIFEST_NAME
from tests.conftest import map_into, write_safetensors
from tests.lora_cache.test_adapters import lora_change, write_adapter
from tests.lora_cache.test_write_way import _no_way_in_this_process, _remember  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(folder) -> nn.Module:
    """Four fp32 linear layers of 4 MiB, read-only mappings of a checkpoint, as a server
    loads them. fp32, so that one kernel sums them: the in-place reference is then the
    build's own arithmetic, whichever kernel a busy machine times faster for bf16."""
    path = os.path.join(folder, "base.safetensors")
    if not os.path.exists(path):  # written once: a start never finds its checkpoint rewritten
        gen = torch.Generator().manual_seed(5)
        write_safetensors(path, {f"{i}.weight": torch.randn(1024, 1024, generator=gen) for i in range(4)})
    return map_into(nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range(4))), path)


def _adapter(folder) -> str:
    path = os.path.join(folder, "lora.safetensors")
    if not os.path.exists(path):
        write_adapter(path, "kohya", {str(i): lora_change(1024, 1024, 16, seed=i, alpha=8) for i in range(4)})
    return path


def _folder(root, key: str) -> str:
    return os.path.join(root, "lora_merge_cache", key)


def _mapped_paths() -> set[str]:
    """The files this process maps (``/proc/self/maps``), by the names they have now."""
    with open("/proc/self/maps") as handle:
        return {line.split(None, 5)[5].strip() for line in handle if len(line.split(None, 5)) == 6}


def _prepare(root, tmp_path, way: str) -> None:
    """``root`` remembers ``way`` as its faster, and knows the base's digest (a start
    hashed it before): the start opens the combination by its key at once."""
    _remember(root, way)
    Vault(root).base_identity([os.path.join(tmp_path, "base.safetensors")])


def _in_place(tmp_path, adapter) -> dict[str, torch.Tensor]:
    model = _model(tmp_path)
    lora_cache.merge(model, [adapter], progress=False, enabled=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_build_in_the_page_cache_serves_the_merge_at_once_and_is_sealed_behind_the_start(tmp_path):
    root, model, adapter = tmp_path / "cache", _model(tmp_path), _adapter(tmp_path)
    _prepare(root, tmp_path, "buffered")
    stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    assert stats.built == 4 and stats.write_way == "buffered" and stats.sealed_behind
    expected = _in_place(tmp_path, adapter)
    assert all(torch.equal(expected[n], p) for n, p in model.named_parameters())  # before the seal is done
    assert wait_sealed(timeout=60)
    folder = _folder(root, stats.cache_key)
    with open(os.path.join(folder, MANIFEST_NAME)) as handle:
        manifest = json.load(handle)
    assert manifest["complete"] and len(manifest["layers"]) == 4
    assert not [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]
    named = {os.path.join(folder, layer["file"]) for layer in manifest["layers"]}
    assert named <= _mapped_paths()  # the weights served are the very files the seal named
    assert all(torch.equal(expected[n], p) for n, p in model.named_parameters())
    assert not os.path.exists(os.path.join(root, "lora_merge_cache", stats.cache_key + ".lock"))


def test_the_startup_report_says_the_build_is_sealed_behind_the_start(tmp_path):
    from types import SimpleNamespace

    from planners.report import _lora_merge_lines
    from planners.startup import merge_stats_dict

    root, model, adapter = tmp_path / "cache", _model(tmp_path), _adapter(tmp_path)
    _prepare(root, tmp_path, "buffered")
    stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    lines = _lora_merge_lines(SimpleNamespace(lora_merge=merge_stats_dict(stats)))
    assert any(line.startswith("  sealed behind the start:") for line in lines), lines
    assert wait_sealed(timeout=60)
    hit = lora_cache.merge(_model(tmp_path), [adapter], cache_root=root, progress=False)
    assert not any("sealed behind" in line for line in _lora_merge_lines(SimpleNamespace(lora_merge=merge_stats_dict(hit))))


def test_a_build_written_around_the_page_cache_is_sealed_before_the_start_returns(tmp_path):
    root, model = tmp_path / "cache", _model(tmp_path)
    _prepare(root, tmp_path, "direct")
    stats = lora_cache.merge(model, [_adapter(tmp_path)], cache_root=root, progress=False)
    assert stats.built == 4 and not stats.sealed_behind
    with open(os.path.join(_folder(root, stats.cache_key), MANIFEST_NAME)) as handle:
        assert json.load(handle)["complete"]


def test_a_second_start_in_the_process_waits_for_the_seal_and_hits(tmp_path):
    root, model, adapter = tmp_path / "cache", _model(tmp_path), _adapter(tmp_path)
    _prepare(root, tmp_path, "buffered")
    first = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    assert first.sealed_behind
    again = _model(tmp_path)
    second = lora_cache.merge(again, [adapter], cache_root=root, progress=False)  # no "already open" refusal
    assert second.hit == 4 and second.built == 0 and second.cache_key == first.cache_key
    expected = _in_place(tmp_path, adapter)
    assert all(torch.equal(expected[n], p) for n, p in again.named_parameters())


_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import lora_cache
    from tests.lora_cache.test_seal_behind import _adapter, _model, _prepare
    root = os.path.join({tmp!r}, "cache")
    model, adapter = _model({tmp!r}), _adapter({tmp!r})
    _prepare(root, {tmp!r}, "buffered")
    stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
    print(stats.cache_key, stats.sealed_behind, flush=True)
    {then}
""")


def _start_child(tmp_path, then: str) -> subprocess.Popen:
    code = _CHILD.format(repo=REPO, tmp=str(tmp_path), then=then)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_a_process_that_ends_right_after_its_start_leaves_its_build_sealed(tmp_path):
    child = _start_child(tmp_path, "")  # returns from the script at once: the exit waits for the seal
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0
    key, behind = out.split()
    assert behind == "True"
    with open(os.path.join(_folder(tmp_path / "cache", key), MANIFEST_NAME)) as handle:
        assert json.load(handle)["complete"]
    model = _model(tmp_path)
    stats = lora_cache.merge(model, [_adapter(tmp_path)], cache_root=tmp_path / "cache", progress=False)
    assert stats.hit == 4


def test_a_process_killed_while_it_seals_leaves_nothing_that_is_served_unsealed(tmp_path):
    child = _start_child(tmp_path, "os.kill(os.getpid(), 9)")  # killed the instant the start returns
    out, _ = child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    key, behind = out.split()
    assert behind == "True"
    Vault(tmp_path / "cache")  # the next start's sweep: temporary files of dead writers go
    folder = _folder(tmp_path / "cache", key)
    assert not os.path.isdir(folder) or not [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]
    model, adapter = _model(tmp_path), _adapter(tmp_path)
    stats = lora_cache.merge(model, [adapter], cache_root=tmp_path / "cache", progress=False)
    assert stats.hit + stats.built == 4  # what was sealed is adopted, the rest built again
    assert wait_sealed(timeout=60)
    expected = _in_place(tmp_path, adapter)
    assert all(torch.equal(expected[n], p) for n, p in model.named_parameters())


_INTERRUPTED = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {repo!r})
    import torch
    from torch import nn
    import lora_cache
    from hostmem.safetensors.mapping import load_readonly
    from tests.conftest import write_safetensors
    from tests.lora_cache.test_adapters import lora_change, write_adapter
    from tests.lora_cache.test_seal_behind import _prepare
    tmp = {tmp!r}
    gen = torch.Generator().manual_seed(3)
    path = os.path.join(tmp, "base.safetensors")
    if not os.path.exists(path):  # the second start finds the first's checkpoint and adapter
        write_safetensors(path, {{f"{{i}}.weight": torch.randn(1024, 1024, generator=gen).to(torch.bfloat16)
                                 for i in range({layers})}})
    model = nn.Sequential(*(nn.Linear(1024, 1024, bias=False) for _ in range({layers})))
    for name, tensor in load_readonly(path).items():
        model.get_submodule(name.split(".")[0])._parameters["weight"] = nn.Parameter(tensor, requires_grad=False)
    changes = {{str(i): {{k: v.to(torch.bfloat16) if k in ("up", "down") else v
                         for k, v in lora_change(1024, 1024, 16, seed=i, alpha=8).items()}} for i in range({layers})}}
    adapter = os.path.join(tmp, "lora.safetensors")
    if not os.path.exists(adapter):
        write_adapter(adapter, "kohya", changes)
    root = os.path.join(tmp, "cache")
    _prepare(root, tmp, "buffered")
    print("ready", flush=True)
    try:
        stats = lora_cache.merge(model, [adapter], cache_root=root, progress=False)
        print("done", stats.hit, stats.built, flush=True)
    except KeyboardInterrupt as exc:
        print("interrupted", exc.sealed_layers, flush=True)
""")


def test_a_build_interrupted_midway_seals_what_it_wrote_before_it_stops_and_the_next_start_resumes(tmp_path):
    layers = 48
    code = _INTERRUPTED.format(repo=REPO, tmp=str(tmp_path), layers=layers)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        cache = tmp_path / "cache" / "lora_merge_cache"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and child.poll() is None and len(_unsealed_layers(cache)) < 3:
            time.sleep(0.002)
        child.send_signal(signal.SIGINT)  # a Ctrl-C while its first layers are in the page cache, unsealed
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    word, *counts = out.split()
    assert word == "interrupted", "the build ended before the interrupt reached it"
    sealed = int(counts[0])
    assert 0 < sealed < layers  # its layers in the page cache were sealed as it stopped, not left
    (folder,) = [os.path.join(cache, n) for n in os.listdir(cache) if os.path.isfile(os.path.join(cache, n, MANIFEST_NAME))]
    with open(os.path.join(folder, MANIFEST_NAME)) as handle:
        manifest = json.load(handle)
    assert not manifest["complete"] and len(manifest["layers"]) == sealed
    assert not [n for n in os.listdir(folder) if n.startswith(TMP_PREFIX)]
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert again.stdout.split()[-3:] == ["done", str(sealed), str(layers - sealed)]  # resumed where it stopped


def _unsealed_layers(cache) -> list[str]:
    """Layer files under ``cache`` still under their temporary names."""
    if not os.path.isdir(cache):
        return []
    return [n for d, _, names in os.walk(cache) for n in names if n.startswith(TMP_PREFIX) and n.endswith(".safetensors")]
