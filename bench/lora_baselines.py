"""bench_lora's baselines beyond the disk: peft's own merge of the same model, and a host
with one busy process per core.

peft's ``merge_and_unload`` is what a server without hostmem runs: the model loaded as
safetensors hands it over (views of a private, writable mapping), the adapter injected
and loaded, every targeted weight written in place. Its time and its anonymous growth
are the floor the cached first start and the in-place path are judged against.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import torch


def _linear_model(shards: list[str]):
    """``blocks.{i}.proj`` as bias-free nn.Linear layers whose weights are safetensors' views."""
    from safetensors import safe_open
    from torch import nn

    root = nn.Module()
    root.blocks = nn.ModuleDict()
    for path in shards:
        with safe_open(path, framework="pt") as handle:
            for name in handle.keys():
                index = name.split(".")[1]
                weight = handle.get_tensor(name)
                layer = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
                layer.weight = nn.Parameter(weight, requires_grad=False)
                root.blocks[index] = nn.ModuleDict({"proj": layer})
    return root


def peft_start(shards: list[str], adapter: str, rank: int) -> dict:
    """Load, inject the adapter with peft, load its weights, ``merge_and_unload``, one pass
    over the weights: a server's start with peft. Returns when it was ready, the merge's
    own seconds and its anonymous growth."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    from hostmem.peak import track_peak_anon

    started = time.perf_counter()
    model = _linear_model(shards)
    factors = load_file(adapter)
    with track_peak_anon() as peak:
        merge_started = time.perf_counter()
        wrapped = get_peft_model(model, LoraConfig(r=rank, lora_alpha=rank, target_modules=["proj"]))
        with torch.no_grad():
            for index, block in wrapped.base_model.model.blocks.items():
                stem = f"diffusion_model.blocks.{index}.proj"
                block["proj"].lora_A["default"].weight.copy_(factors[f"{stem}.lora_down.weight"])
                block["proj"].lora_B["default"].weight.copy_(factors[f"{stem}.lora_up.weight"])
        merged = wrapped.merge_and_unload()
        merge_s = time.perf_counter() - merge_started
    weights = [p for p in merged.parameters()]
    staging = torch.empty(max(w.numel() for w in weights), dtype=weights[0].dtype)
    for weight in weights:
        staging[: weight.numel()].view(weight.shape).copy_(weight)
    return {"ready_at": time.time(), "in_process_s": time.perf_counter() - started, "merge_s": merge_s,
            "growth": peak.growth_bytes}


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes that each keep a core busy (a pure Python loop), for the duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2)  # running before the measured start begins
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def first_starts(scenario, shards: list[str], adapter: str, folder: str, rounds: int = 2) -> dict:
    """Launch-to-ready seconds of a first start (an empty cache: the build included), of a
    start that merges with peft instead, taking turns, and of a first start with one busy
    process per core; best of ``rounds`` each. The page cache holds the base for all."""
    import shutil

    found = {"miss": [], "peft": [], "busy": [], "peft_merge_s": [], "peft_growth": []}

    def miss() -> float:
        root = os.path.join(folder, "first-start-cache")
        shutil.rmtree(os.path.join(root, "lora_merge_cache"), ignore_errors=True)  # the wisdom stays
        spawned = time.time()
        run = scenario("start", shards=shards, adapter=adapter, root=root)
        assert run["stats"]["built"] == run["stats"]["layers"], run["stats"]
        return run["ready_at"] - spawned

    miss()  # untimed: the kernels are timed once per machine, not per start
    for _ in range(rounds):
        found["miss"].append(miss())
        spawned = time.time()
        run = scenario("peft_start", shards=shards, adapter=adapter)
        found["peft"].append(run["ready_at"] - spawned)
        found["peft_merge_s"].append(run["merge_s"])
        found["peft_growth"].append(run["growth"])
    with busy_cores(cpu_count()):
        for _ in range(rounds):
            found["busy"].append(miss())
    return found
