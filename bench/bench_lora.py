"""The LoRA merge cache against the in-place merge, side by side in one run.

A synthetic bf16 DiT (48 layers by default) and a rank-64 adapter on every layer.
Each scenario runs in its own fresh process, so no heap, page mapping or allocator
state carries from one to the next; the parent only writes files and compares:

- peak anonymous growth: cached build / in-place merge (goal <= 0.05). The in-place
  merge runs on the model as servers load it (safetensors' private mapping).
- build throughput: merged bytes per second of the cache build / raw sequential write
  throughput of the same disk, measured right before it (goal >= 0.7).
- start: from launching the process to ready (imports, load, merge from a cache hit,
  one pass over every weight) / the same for the base without LoRA (goal <= 1.1),
  page cache warm for both, best of three; the part after imports is shown beside it.

    flock /tmp/hostmem-bench.lock .venv/bin/python bench/bench_lora.py            # 4 GiB
    .venv/bin/python bench/bench_lora.py --quick                                   # 256 MiB smoke run
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

from common import bench_args, format_size, report, save_file, workdir  # noqa: E402 (sets sys.path)

LAYERS = 48
COLS = 5120
RANK = 64
SHARDS = 4


def write_model(folder: str, size: int) -> tuple[list[str], str]:
    """A ``size``-byte bf16 checkpoint of LAYERS square-ish layers, and a rank-64 adapter."""
    rows = max(64, size // (LAYERS * COLS * 2))
    gen = torch.Generator().manual_seed(0)
    per_shard = -(-LAYERS // SHARDS)
    shards = []
    for shard in range(SHARDS):
        names = range(shard * per_shard, min(LAYERS, (shard + 1) * per_shard))
        tensors = {f"blocks.{i}.proj.weight": torch.randn(rows, COLS, generator=gen).to(torch.bfloat16) for i in names}
        shards.append(os.path.join(folder, f"dit-{shard + 1:05d}-of-{SHARDS:05d}.safetensors"))
        save_file(tensors, shards[-1])
        del tensors
    adapter = {}
    for i in range(LAYERS):
        stem = f"diffusion_model.blocks.{i}.proj"
        adapter[f"{stem}.lora_down.weight"] = (torch.randn(RANK, COLS, generator=gen) / COLS**0.5).to(torch.bfloat16)
        adapter[f"{stem}.lora_up.weight"] = (torch.randn(rows, RANK, generator=gen) * 0.01).to(torch.bfloat16)
        adapter[f"{stem}.alpha"] = torch.tensor(float(RANK))
    adapter_path = os.path.join(folder, "turbo-r64.safetensors")
    save_file(adapter, adapter_path)
    return shards, adapter_path


# ----------------------------------------------------------------- scenarios (child processes)


def _touch(tensors: list[torch.Tensor]) -> None:
    """One pass over every weight into a staging buffer, as streaming them to a GPU reads them."""
    staging = torch.empty(max(t.numel() for t in tensors), dtype=tensors[0].dtype)
    for tensor in tensors:
        staging[: tensor.numel()].view(tensor.shape).copy_(tensor)


def _load(shards: list[str], private: bool):
    from lora_cache.layers import checkpoint_module, module_tree

    if not private:
        return checkpoint_module(shards)
    return module_tree(item for path in shards for item in _private_tensors(path))


def _private_tensors(path: str) -> list:
    """Every tensor of ``path`` as safetensors' own loader gives it: views of a private, writable
    mapping (``safe_open(...).get_tensor``, which unlike ``safetensors.torch`` needs no numpy)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as handle:
        return [(name, handle.get_tensor(name)) for name in handle.keys()]


def _merge_measured(shards, adapter, root, private) -> dict:
    import lora_cache
    from hostmem.peak import track_peak_anon

    model = _load(shards, private)
    with track_peak_anon() as peak:
        stats = lora_cache.merge(model, [adapter], cache_root=root, base_files=shards, progress=False)
    return {"growth": peak.growth_bytes, "peak": peak.peak_bytes, "stats": stats.to_dict()}


def _start(shards, adapter, root) -> dict:
    """Load (+ merge from the cache) + one pass over the weights, then say when it was ready.

    The base start never imports lora_cache, as a server without LoRA would not.
    """
    from hostmem.safetensors_map import load_readonly

    started = time.perf_counter()
    named = [item for path in shards for item in load_readonly(path).items()]
    stats = None
    if adapter:
        import lora_cache
        from lora_cache.layers import module_tree

        model = module_tree(named)
        stats = lora_cache.merge(model, [adapter], cache_root=root, base_files=shards, progress=False).to_dict()
        named = list(model.named_parameters())
    _touch([t for _, t in named])
    return {"ready_at": time.time(), "in_process_s": time.perf_counter() - started, "stats": stats}


def _raw_write(folder: str, nbytes: int, chunk: int = 64 << 20) -> dict:
    """Sequential write of ``nbytes`` (random data) to one file in ``folder``, then fsync."""
    buffer = memoryview(os.urandom(chunk))
    path = os.path.join(folder, "raw-write.bin")
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, buffer[: min(chunk, nbytes - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
        seconds = time.perf_counter() - started
        os.unlink(path)
    return {"seconds": seconds, "bytes": written}


def run_scenario(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    name, spec = argv[0], json.loads(argv[1])
    if name == "raw_write":
        result = _raw_write(spec["folder"], spec["bytes"])
    elif name in ("in_place", "build"):
        result = _merge_measured(spec["shards"], spec["adapter"], spec.get("root"), spec.get("private", False))
    else:
        result = _start(spec["shards"], spec.get("adapter"), spec.get("root"))
    print(json.dumps(result))


# ----------------------------------------------------------------- the parent


def scenario(name: str, **spec) -> dict:
    done = subprocess.run([sys.executable, __file__, "--scenario", name, json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"scenario {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def warm(paths: list[str]) -> None:
    """Read files once so that both starts find them in the page cache."""
    buffer = bytearray(64 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def main() -> None:
    args = bench_args("LoRA merge cache vs in-place merge", default_size="4GiB", quick_size="256MiB")
    tmp = workdir(args)
    shards, adapter = write_model(args.workdir, args.size_bytes)
    merged = sum(os.path.getsize(s) for s in shards)
    root = os.path.join(args.workdir, "cache")
    os.makedirs(root, mode=0o700, exist_ok=True)
    in_place = scenario("in_place", shards=shards, adapter=adapter, private=True)
    raw_before = scenario("raw_write", folder=root, bytes=merged)
    build = scenario("build", shards=shards, adapter=adapter, root=root)
    raw_after = scenario("raw_write", folder=root, bytes=merged)
    raw_rate = sum(r["bytes"] / r["seconds"] for r in (raw_before, raw_after)) / 2
    cache_files = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".safetensors")]
    warm(shards + cache_files)
    starts = {"base": [], "hit": []}
    for _ in range(3):
        for kind, extra in (("base", {}), ("hit", {"adapter": adapter, "root": root})):
            spawned = time.time()
            run = scenario("start", shards=shards, **extra)
            assert kind == "base" or run["stats"]["hit"] == LAYERS, run
            starts[kind].append((run["ready_at"] - spawned, run["in_process_s"]))
    summarize(merged, in_place, build, raw_rate, starts)
    if tmp is not None:
        tmp.cleanup()


def summarize(merged, in_place, build, raw_rate, starts) -> None:
    build_stats = build["stats"]
    build_rate = build_stats["bytes"] / build_stats["seconds"]
    (hit_s, hit_in), (base_s, base_in) = (tuple(min(x) for x in zip(*starts[k])) for k in ("hit", "base"))
    ratios = {
        "peak_anon_cached_over_in_place": build["growth"] / max(1, in_place["growth"]),
        "build_over_raw_write": build_rate / raw_rate,
        "hit_start_over_base_start": hit_s / base_s,
        "hit_over_base_after_imports": hit_in / base_in,
    }
    lines = [
        f"model: {format_size(merged)} bf16, {LAYERS} layers, rank-{RANK} adapter on every layer",
        f"peak anonymous growth: cached {format_size(build['growth'])}, in place {format_size(in_place['growth'])}"
        f"  -> ratio {ratios['peak_anon_cached_over_in_place']:.3f} (goal <= 0.05)",
        f"cache build {format_size(build_rate)}/s ({build_stats['seconds']:.1f} s), raw sequential write "
        f"{format_size(raw_rate)}/s (mean of one before, one after)  -> ratio "
        f"{ratios['build_over_raw_write']:.2f} (goal >= 0.7)",
        f"start (launch to ready, best of 3): cache hit {hit_s:.2f} s, base without LoRA {base_s:.2f} s"
        f"  -> ratio {ratios['hit_start_over_base_start']:.2f} (goal <= 1.1)",
        f"  of which after imports: cache hit {hit_in:.2f} s, base {base_in:.2f} s"
        f"  -> ratio {ratios['hit_over_base_after_imports']:.2f}",
        f"in-place merge took {in_place['stats']['seconds']:.1f} s",
    ]
    report("bench_lora", lines, {
        "model_bytes": merged, "layers": LAYERS, "rank": RANK, **ratios,
        "peak_anon_growth_cached_bytes": build["growth"], "peak_anon_growth_in_place_bytes": in_place["growth"],
        "build_bytes_per_s": build_rate, "raw_write_bytes_per_s": raw_rate,
        "build_seconds": build_stats["seconds"], "in_place_seconds": in_place["stats"]["seconds"],
        "hit_start_s": hit_s, "base_start_s": base_s, "hit_after_imports_s": hit_in, "base_after_imports_s": base_in,
    })


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--scenario":
        run_scenario(sys.argv[2:])
    else:
        main()
