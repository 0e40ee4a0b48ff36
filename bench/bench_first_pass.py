"""First start to first image: a start plus one pass over every weight, each way a server starts.

What a server's user waits for is the start and the first pass, which reads every weight:
a cache that merges fast but leaves its layers on the disk, or reads them back slower
than the checkpoint, only moves the wait into the first image. Four ways, each in a fresh
process, the page cache of the base, the adapter and the cache root dropped before each
(``posix_fadvise(DONTNEED)`` on every file), three rounds in a rotating order, medians.
A virtual machine's disk is cached by its host, which keeps whichever files were read
last: the base, read by three ways of four, came from the host's memory at up to 5 GiB/s
while a hit's layers came from its disk at 1 GiB/s, or the other way round. So before
each start every file it may read is also read once with ``O_DIRECT``, which leaves
nothing in this machine's page cache and all of it in the host's: every way reads its
files from the same place, the place where per-file costs weigh most.

- miss: ``lora_cache.merge`` on a cache emptied of combinations (the base's digests,
  the kernel timings and the measured write way kept, as every build after the first on
  a base; the line says which way it wrote, and whether it sealed behind the start: the
  seconds its durable part ran on after the pass are reported beside, not counted), then
  the pass;
- new base: the same on a base no start has hashed (the memo of its digests removed too:
  a new or copied checkpoint), so the build folds the base's hash (hostmem.vault.fold),
  then the pass;
- in place: ``lora_cache.merge(enabled=False)`` on the model as safetensors hands it over
  (views of a private mapping), then the pass;
- hit: ``lora_cache.merge`` on the combination built by the last miss, then the pass;
- no LoRA: the checkpoint mapped read-only, then the pass.

The clock of each starts after the imports a server makes before it starts serving
(torch, and for the three with LoRA ``import lora_cache``; the import's own time is
reported beside), and after one full garbage collection (see bench_lora's ``_start``).
The pass copies every weight into one staging buffer, as streaming it to a GPU reads it.
Models: the same bytes in 128 and in 512 layers of 1024 columns, and a model four times
larger in 512 layers; a rank-16 adapter on every layer whose update is a few bf16 steps
of the weights it changes (``UPDATE_ULPS``), so that no layer's update rounds away.

Two regimes, each the whole set of rounds: every start right after its drop, and every
start ``SETTLE_S`` seconds after it. A virtual machine whose balloon reports free pages
hands them back to its host about two seconds after they are freed, and new memory
touched after that is a fault in the host too: huge pages cost 35-60x more there
(``fresh_memory_cost``, measured and printed first). Right after the drop, a start reuses
the memory the drop freed at no such cost; a server's first start on a machine that sat
idle finds it settled. The in-place merge allocates its merged copies and pays it; the
others read into the page cache, which the host's own reads fill.

Goals: (miss + pass) <= 1.0 x (in place + pass); (hit + pass) <= 1.15 x (no LoRA + pass);
the hit's cold pass reads the merged layers at >= 0.9 of the rate the no-LoRA pass reads
the checkpoint. The disk's own sequential read rate (large reads of the checkpoint's
files, dropped first and read around as above) is measured in every round beside them.

    flock /tmp/hostmem-bench.lock .venv/bin/python bench/bench_first_pass.py     # 1 GiB and 4 GiB, both regimes
    .venv/bin/python bench/bench_first_pass.py --quick                           # 8 MiB smoke run
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import sys
import time

import torch  # noqa: F401  (imported before any clock, as a server has it)

from common import (  # noqa: E402 (sets sys.path)
    SETTLE_S, bench_args, child_scenario, drop_from_page_cache, format_size, fresh_memory_cost, read_around_page_cache,
    report, stream_pass, workdir, write_lora_model,
)

COLS = 1024
RANK = 16
SHARDS = 4
ROUNDS = 3
UPDATE_ULPS = 3  # the update's spread in bf16 steps of a weight of magnitude one (2**-7 each)
KINDS = ("miss", "new_base", "in_place", "hit", "none")
REGIMES = {  # seconds each start waits after the drop, and what that is
    "right after the drop": 0.0,
    "free memory settled": SETTLE_S,
}


def models(size: int) -> list[tuple[int, int]]:
    """(bytes, layers) of each model measured: ``size`` in 128 and 512 layers, 4x ``size`` in 512."""
    return [(size, 128), (size, 512), (4 * size, 512)]


def write_model(folder: str, size: int, layers: int) -> tuple[list[str], str]:
    """A ``size``-byte bf16 checkpoint of ``layers`` layers of COLS columns, and a rank-16 adapter."""
    rows = max(8, size // (layers * COLS * 2))
    return write_lora_model(folder, layers, rows, COLS, RANK, "lora-r16.safetensors", SHARDS, UPDATE_ULPS)


# ----------------------------------------------------------------- one start (a child process)


def _private_model(shards: list[str]):
    """The model as safetensors' own loader hands it over: views of a private, writable mapping."""
    from safetensors import safe_open

    from lora_cache.placement.layers import module_tree

    named = []
    for path in shards:
        with safe_open(path, framework="pt") as handle:
            named += [(name, handle.get_tensor(name)) for name in handle.keys()]
    return module_tree(named)


def start(kind: str, shards: list[str], adapter: str, root: str) -> dict:
    """Start ``kind`` and make one pass; the seconds of each, after the imports."""
    from hostmem.safetensors.mapping import load_readonly

    imported = time.perf_counter()
    if kind != "none":  # what a server with LoRA imports at its own import
        from lora_cache import merge
        from lora_cache.placement.layers import module_tree
    import_s = time.perf_counter() - imported
    gc.collect()
    modules = set(sys.modules)
    started = time.perf_counter()
    stats = None
    if kind == "none":
        tensors = [t for path in shards for t in load_readonly(path).values()]
    else:
        model = (_private_model(shards) if kind == "in_place"
                 else module_tree([item for path in shards for item in load_readonly(path).items()]))
        stats = merge(model, [adapter], root if kind != "in_place" else None, base_files=shards,
                                 progress=False, enabled=kind != "in_place").to_dict()
        tensors = [p for _, p in model.named_parameters()]
    ready = time.perf_counter()
    started_with = sorted(set(sys.modules) - modules)  # imported inside the clock
    nbytes = stream_pass(tensors)
    passed = time.perf_counter()
    if stats is not None:  # a build sealed behind its start: how long the durable part ran on after the pass
        from lora_cache import wait_sealed

        wait_sealed()
    return {"start_s": ready - started, "pass_s": passed - ready, "pass_bytes": nbytes, "import_s": import_s,
            "stats": stats, "modules_in_start": started_with, "sealed_after_pass_s": time.perf_counter() - passed}


def read_rate(paths: list[str]) -> float:
    """The disk's sequential read rate over ``paths`` (dropped first): large preads, one file
    after another, bytes per second."""
    drop_from_page_cache(paths)
    read_around_page_cache(paths)
    buffer = bytearray(16 << 20)
    total, started = 0, time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while (n := os.readv(fd, [buffer])) > 0:
                total += n
        finally:
            os.close(fd)
    seconds = time.perf_counter() - started
    drop_from_page_cache(paths)
    return total / seconds


# ----------------------------------------------------------------- the parent


def scenario(kind: str, **spec) -> dict:
    return child_scenario(__file__, kind, spec)


def files_under(folder: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(folder) for f in names
            if os.path.isfile(os.path.join(d, f)) and not os.path.islink(os.path.join(d, f))]


def empty_cache(root: str, memo: bool = True) -> None:
    """Remove every combination under ``root``, keeping the kernel timings and (``memo``) the
    memo of input digests: the miss is measured as every build after the first on a base
    runs, the new base as the first."""
    from hostmem.vault.store import MEMO_NAME

    cache = os.path.join(root, "lora_merge_cache")
    for entry in os.listdir(cache) if os.path.isdir(cache) else []:
        path = os.path.join(cache, entry)
        if entry == MEMO_NAME and not memo:
            os.unlink(path)
        if entry == MEMO_NAME or not os.path.isdir(path) or os.path.islink(path) or len(entry) < 32:
            continue
        shutil.rmtree(path)
        for leftover in (path + ".lock", path + ".use"):
            if os.path.exists(leftover):
                os.unlink(leftover)


def rounds(shards: list[str], adapter: str, root: str, layers: int, settle_s: float) -> tuple[dict, list[float]]:
    """ROUNDS rounds of the four kinds in a rotating order, each start ``settle_s`` seconds
    after its drop: ``(runs by kind, disk read rates)``."""
    os.sync()
    scenario("miss", shards=shards, adapter=adapter, root=root)  # untimed: kernels timed, bytecode written
    runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
    disk = []
    for round_ in range(ROUNDS):
        order = KINDS[round_:] + KINDS[:round_]
        for kind in order:
            if kind in ("miss", "new_base"):
                empty_cache(root, memo=kind == "miss")
            os.sync()  # nothing the previous run left dirty is written back during this one
            inputs = shards + [adapter] + files_under(root)
            drop_from_page_cache(inputs)
            read_around_page_cache(inputs)
            time.sleep(settle_s)
            run = scenario(kind, shards=shards, adapter=adapter, root=root)
            stats = run["stats"]
            expected = {"miss": "built", "new_base": "built", "hit": "hit", "in_place": "in_place"}.get(kind)
            if expected and stats[expected] != layers:
                raise SystemExit(f"{kind}: {stats[expected]} of {layers} layers {expected}: {stats}")
            runs[kind].append(run)
        disk.append(read_rate(shards))
    return runs, disk


def summarize(size: int, layers: int, regime: str, runs: dict, disk: list[float]) -> tuple[list[str], dict]:
    med = {kind: {part: statistics.median(r[part] for r in runs[kind]) for part in ("start_s", "pass_s", "import_s")}
           for kind in KINDS}
    total = {kind: med[kind]["start_s"] + med[kind]["pass_s"] for kind in KINDS}
    pass_bytes = runs["none"][0]["pass_bytes"]
    rate = {kind: pass_bytes / med[kind]["pass_s"] for kind in KINDS}
    figures = {
        "miss_over_in_place": total["miss"] / total["in_place"],
        "new_base_over_in_place": total["new_base"] / total["in_place"],
        "hit_over_none": total["hit"] / total["none"],
        "hit_pass_rate_over_checkpoint": rate["hit"] / rate["none"],
        "miss_pass_rate_over_checkpoint": rate["miss"] / rate["none"],
    }
    names = {"miss": "cached first start (miss)", "new_base": "first start, new base", "in_place": "in-place merge",
             "hit": "hit", "none": "no LoRA"}
    lines = [f"model: {format_size(size)} bf16, {layers} layers of {COLS} columns, rank-{RANK} adapter on every "
             f"layer (updates ~{UPDATE_ULPS} bf16 steps), {regime}; disk reads {format_size(statistics.median(disk))}"
             f"/s (median of {', '.join(format_size(d) + '/s' for d in disk)})"]
    builds = ("miss", "new_base")
    ways = sorted({r["stats"].get("write_way") or "none" for kind in builds for r in runs[kind]})
    behind = {kind: [r["sealed_after_pass_s"] for r in runs[kind] if r["stats"].get("sealed_behind")]
              for kind in builds}
    sealed = {kind: f", sealed behind the start ({statistics.median(behind[kind]):.2f} s more after the pass)"
              if behind[kind] else ", sealed in the start" for kind in builds}
    for kind in KINDS:
        starts = ", ".join(f"{r['start_s']:.2f}" for r in runs[kind])
        passes = ", ".join(f"{r['pass_s']:.2f}" for r in runs[kind])
        lines.append(f"  {names[kind]:<26} start {med[kind]['start_s']:.2f} s ({starts}) + pass "
                     f"{med[kind]['pass_s']:.2f} s ({passes}) = {total[kind]:.2f} s; pass reads "
                     f"{format_size(rate[kind])}/s" + (f"; import lora_cache {med[kind]['import_s'] * 1e3:.0f} ms"
                                                        if kind != "none" else "")
                     + (f"; wrote {'/'.join(ways)}{sealed[kind]}" if kind in builds else ""))
    lines += [f"  (miss + pass) / (in place + pass) {figures['miss_over_in_place']:.2f} (goal <= 1.0); new base: "
              f"{figures['new_base_over_in_place']:.2f}",
              f"  (hit + pass) / (no LoRA + pass) {figures['hit_over_none']:.2f} (goal <= 1.15)",
              f"  hit's cold pass / the checkpoint's {figures['hit_pass_rate_over_checkpoint']:.2f} (goal >= 0.9); "
              f"the miss's pass / the checkpoint's {figures['miss_pass_rate_over_checkpoint']:.2f}"]
    summary = {"model_bytes": size, "layers": layers, "regime": regime, "settle_s": REGIMES[regime], "write_ways": ways,
               "sealed_behind_runs": {k: len(v) for k, v in behind.items()}, "sealed_after_pass_s": behind,
               "disk_read_bytes_per_s": disk, **figures,
               "seconds": {kind: {**med[kind], "total": total[kind]} for kind in KINDS},
               "runs": {kind: [{k: r[k] for k in ("start_s", "pass_s", "import_s")} for r in runs[kind]]
                        for kind in KINDS}}
    return lines, summary


def main() -> None:
    args = bench_args("first start + first pass: miss, in place, hit, no LoRA", default_size="1GiB",
                      quick_size="8MiB", switches={"--right-after-drop": "only the regime of starts right after "
                                                   "their drop (half the time)"})
    regimes = {k: v for k, v in REGIMES.items() if not args.right_after_drop or not v}
    tmp = workdir(args)
    memory = fresh_memory_cost()
    lines = [f"new memory (huge pages) costs {memory['recycled']:.2f} s/GiB right after as much was freed, "
             f"{memory['settled']:.2f} s/GiB after {SETTLE_S:.0f} s idle; each regime below starts every way "
             f"that long after its drop"]
    results = []
    try:
        for size, layers in models(args.size_bytes):
            folder = os.path.join(args.workdir, f"model-{size}-{layers}")
            shards, adapter = write_model(folder, size, layers)
            root = os.path.join(folder, "cache")
            os.makedirs(root, mode=0o700, exist_ok=True)
            for regime, settle_s in regimes.items():
                runs, disk = rounds(shards, adapter, root, layers, settle_s)
                text, summary = summarize(sum(os.path.getsize(s) for s in shards), layers, regime, runs, disk)
                lines += text
                results.append(summary)
            shutil.rmtree(folder)
    finally:
        if tmp is not None:
            tmp.cleanup()
    worst = {}
    for regime in regimes:
        mine = [r for r in results if r["regime"] == regime]
        worst[regime] = {key: max(r[key] for r in mine)
                         for key in ("miss_over_in_place", "new_base_over_in_place", "hit_over_none")}
        worst[regime]["hit_pass_rate_over_checkpoint"] = min(r["hit_pass_rate_over_checkpoint"] for r in mine)
    report("bench_first_pass", lines, {"fresh_memory_s_per_gib": memory, "models": results, "worst": worst})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--scenario":
        import warnings

        warnings.filterwarnings("ignore")
        kind, spec = sys.argv[2], json.loads(sys.argv[3])
        print(json.dumps(start(kind, spec["shards"], spec["adapter"], spec["root"])))
    else:
        main()
