"""Switching adapters on a live model: hostmem's switch beside peft's and diffusers', one run.

A bf16 ``FluxTransformer2DModel`` from a shallow config (Flux's width, few double
blocks: 512 MiB by default), saved with ``save_pretrained``, and two rank-32
diffusers-format LoRAs on every linear of its double blocks. Three combinations: A, B,
and A at half strength. Each contender runs in its own fresh process, loading the model
with ``from_pretrained`` (diffusers maps the file), under ``hostmem.track_peak_anon``:

- ``hostmem``: ``lora_cache.set_adapters``. A first visit serves at run time at once and
  builds in the background (its latency and the build's time until ``swap_ready`` has
  swapped it in are measured); then every switch among the three is a cached one
  (re-pointing at the vault's mapped files); last, one forward pass with the
  combination merged against the same combination applied at run time;
- ``peft``: both adapters loaded as peft layers; a switch is peft's own per-layer
  ``unmerge``, ``set_adapter`` and ``merge`` (A and B: peft's set_adapter has no strength);
- ``diffusers``: both adapters loaded with ``load_lora_adapter``; a switch is
  ``unfuse_lora``, ``set_adapters(names, weights)`` and ``fuse_lora``.

Figures: switch latency (hostmem cached and run time, against peft's and diffusers'
median), the forward overhead of run-time LoRA over merged weights, and the anonymous
growth over the series of switches from the loaded model: hostmem's cached switches /
the in-place re-merge's (diffusers'; floor <= 0.02). Not part of ``run_all.py``:

    .venv/bin/python bench/bench_switch.py            # 512 MiB, a couple of minutes
    .venv/bin/python bench/bench_switch.py --quick    # 64 MiB smoke run
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from bench_diffusers import _config, _load  # noqa: E402 (the shallow Flux of the diffusers bench)
from common import bench_args, format_size, report, save_file, workdir  # noqa: E402 (sets sys.path)

RANK = 32
SWITCHES = 6  # each contender's series of switches among its combinations, after the first visits
FORWARDS = 3  # forward calls timed per kind (the median counts)
COMBINATIONS = {"a": [("a", 1.0)], "b": [("b", 1.0)], "a_half": [("a", 0.5)]}


def write_inputs(folder: str, size: int) -> dict[str, str]:
    """Save the transformer and two rank-32 LoRAs on every double-block linear; return their paths."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**_config(size)).to(torch.bfloat16)
    model.save_pretrained(os.path.join(folder, "transformer"))
    paths = {}
    for seed, name in enumerate(("a", "b"), start=1):
        gen, lora = torch.Generator().manual_seed(seed), {}
        for module_name, module in model.named_modules():
            if module_name.startswith("transformer_blocks.") and isinstance(module, torch.nn.Linear):
                down = torch.randn(RANK, module.in_features, generator=gen) / 64
                up = torch.randn(module.out_features, RANK, generator=gen) / 64
                lora[f"transformer.{module_name}.lora_A.weight"] = down.to(torch.bfloat16)
                lora[f"transformer.{module_name}.lora_B.weight"] = up.to(torch.bfloat16)
        paths[name] = os.path.join(folder, f"{name}.safetensors")
        save_file(lora, paths[name])
    return paths


def _inputs(model) -> dict:
    """One small Flux call: 64 image tokens, 16 text tokens."""
    config, gen = model.config, torch.Generator().manual_seed(0)
    image, text = 64, 16
    return dict(
        hidden_states=torch.randn(1, image, config.in_channels, generator=gen).to(torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, generator=gen).to(torch.bfloat16),
        pooled_projections=torch.randn(1, config.pooled_projection_dim, generator=gen).to(torch.bfloat16),
        timestep=torch.tensor([0.5]), img_ids=torch.zeros(image, 3), txt_ids=torch.zeros(text, 3), return_dict=False,
    )


def _forward_s(model, inputs) -> float:
    """The median of :data:`FORWARDS` timed forward calls (after one untimed)."""
    times = []
    with torch.inference_mode():
        for i in range(FORWARDS + 1):
            start = time.perf_counter()
            model(**inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _series() -> list[str]:
    """The switches after the first visits: every combination in turn, then again."""
    names = list(COMBINATIONS)
    return [names[(i + 1) % len(names)] for i in range(SWITCHES)]


# ---- contenders: each runs in a child process and prints one JSON line ----

def _hostmem(folder: str, paths: dict) -> dict:
    import hostmem
    import lora_cache
    from lora_cache.orchestrate import plan_targets
    from lora_cache.placement.runtime_lora import apply_runtime, remove_runtime

    model, root = _load(folder), os.path.join(folder, "cache")
    combos = {k: [(paths[a], s) for a, s in v] for k, v in COMBINATIONS.items()}
    first, builds = [], []
    with hostmem.track_peak_anon() as first_peak:
        for adapters in combos.values():
            result = lora_cache.set_adapters(model, adapters, cache_root=root)
            first.append(result.seconds)
            start = time.perf_counter()
            lora_cache.swap_ready(model, wait=True)
            builds.append(time.perf_counter() - start)
    cached, modes = [], set()
    with hostmem.track_peak_anon() as cached_peak:
        for name in _series():
            result = lora_cache.set_adapters(model, combos[name], cache_root=root)
            cached.append(result.seconds)
            modes.add(result.mode)
    inputs = _inputs(model)
    merged_fwd = _forward_s(model, inputs)  # the last combination of the series, merged
    lora_cache.set_adapters(model, [], cache_root=root)
    apply_runtime(plan_targets(model, combos[name])[0])  # the same combination at run time
    runtime_fwd = _forward_s(model, inputs)
    remove_runtime(model)
    return {"runtime_switch_s": first, "build_and_swap_s": builds, "cached_switch_s": cached,
            "cached_modes": sorted(modes), "forward_runtime_s": runtime_fwd, "forward_merged_s": merged_fwd,
            "forward_overhead": runtime_fwd / merged_fwd,
            "first_visit_growth_bytes": first_peak.growth_bytes, "growth_bytes": cached_peak.growth_bytes}


def _loaded_with_peft_layers(folder: str, paths: dict):
    model = _load(folder)
    for name, path in paths.items():
        model.load_lora_adapter(path, adapter_name=name, prefix="transformer")
    return model


def _peft(folder: str, paths: dict) -> dict:
    import hostmem
    from peft.tuners.tuners_utils import BaseTunerLayer

    model = _loaded_with_peft_layers(folder, paths)
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def switch(name: str) -> float:
        start = time.perf_counter()
        for layer in layers:
            if layer.merged:
                layer.unmerge()
            layer.set_adapter(name)
            layer.merge(adapter_names=[name])
        return time.perf_counter() - start

    with hostmem.track_peak_anon() as peak:
        times = [switch("a" if i % 2 == 0 else "b") for i in range(SWITCHES + 1)]
    return {"switch_s": times[1:], "first_switch_s": times[0], "growth_bytes": peak.growth_bytes}


def _diffusers(folder: str, paths: dict) -> dict:
    import hostmem

    model = _loaded_with_peft_layers(folder, paths)

    def switch(name: str, fused: bool) -> float:
        names, weights = zip(*COMBINATIONS[name])
        start = time.perf_counter()
        if fused:
            model.unfuse_lora()
        model.set_adapters(list(names), list(weights))
        model.fuse_lora(adapter_names=list(names))
        return time.perf_counter() - start

    with hostmem.track_peak_anon() as peak:
        times = [switch(name, fused=i > 0) for i, name in enumerate(["a", *_series()])]
    return {"switch_s": times[1:], "first_switch_s": times[0], "growth_bytes": peak.growth_bytes}


CONTENDERS = {"hostmem": _hostmem, "peft": _peft, "diffusers": _diffusers}


def _child(name: str, folder: str, paths: dict) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, folder, json.dumps(paths)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"contender {name!r} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f} ms"


def _lines(model_bytes: int, r: dict, ratios: dict) -> list[str]:
    hm, med = r["hostmem"], statistics.median
    return [
        f"model {format_size(model_bytes)} bf16 (shallow Flux), two rank-{RANK} LoRAs on every double-block linear",
        f"switch latency  hostmem cached {_ms(med(hm['cached_switch_s']))}"
        f"   hostmem run time {_ms(med(hm['runtime_switch_s']))}"
        f"   peft unmerge+set_adapter+merge {_ms(med(r['peft']['switch_s']))}"
        f"   diffusers unfuse+set_adapters+fuse {_ms(med(r['diffusers']['switch_s']))}",
        f"first visit: background build until swapped in (median) {_ms(med(hm['build_and_swap_s']))}",
        f"forward: run-time LoRA / merged weights {ratios['forward_overhead']:.2f}x "
        f"({_ms(hm['forward_runtime_s'])} / {_ms(hm['forward_merged_s'])})",
        f"anonymous growth over {SWITCHES} switches  hostmem cached {format_size(hm['growth_bytes'])}   "
        f"peft {format_size(r['peft']['growth_bytes'])}   diffusers {format_size(r['diffusers']['growth_bytes'])}"
        f"   (hostmem's three first visits, run time + build: {format_size(hm['first_visit_growth_bytes'])})",
        f"cached switch latency / peft: {ratios['latency_vs_peft']:.3f}"
        f"   / diffusers: {ratios['latency_vs_diffusers']:.3f}",
        f"hostmem growth / in-place re-merge (diffusers): {ratios['growth_vs_in_place']:.4f} (floor <= 0.02)",
    ]


def main() -> None:
    args = bench_args(__doc__.splitlines()[0], default_size="512MiB", quick_size="64MiB")
    tmp = workdir(args)
    try:
        paths = write_inputs(args.workdir, args.size_bytes)
        model_bytes = os.path.getsize(os.path.join(args.workdir, "transformer", "diffusion_pytorch_model.safetensors"))
        results = {name: _child(name, args.workdir, paths) for name in CONTENDERS}
    finally:
        if tmp is not None:
            tmp.cleanup()
    hm, med = results["hostmem"], statistics.median
    ratios = {
        "forward_overhead": hm["forward_overhead"],
        "latency_vs_peft": med(hm["cached_switch_s"]) / med(results["peft"]["switch_s"]),
        "latency_vs_diffusers": med(hm["cached_switch_s"]) / med(results["diffusers"]["switch_s"]),
        "growth_vs_in_place": hm["growth_bytes"] / max(1, results["diffusers"]["growth_bytes"]),
    }
    summary = {"model_bytes": model_bytes, "contenders": results, **ratios}
    report("switch", _lines(model_bytes, results, ratios), summary)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, folder, paths = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
        print(json.dumps(CONTENDERS[name](folder, paths)))
    else:
        main()
