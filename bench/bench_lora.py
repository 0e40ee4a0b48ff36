"""The LoRA merge cache against the in-place merge, side by side in one run.

A synthetic bf16 DiT (48 layers by default), a rank-64 adapter on every layer (updates of ~3 bf16 steps).
Each scenario runs in its own fresh process, so no heap, page mapping or allocator
state carries from one to the next; the parent only writes files and compares:

- peak anonymous growth: cached build / in-place merge (goal <= 0.05). The in-place
  merge runs on the model as servers load it (safetensors' private mapping).
- build throughput: merged bytes per second of the cache build / raw sequential write
  throughput of the same disk (goal >= 0.7): one file written and fsynced both
  through the page cache and with O_DIRECT, the faster counting. Beside them, the
  cache's write path alone (ready layers put, no arithmetic) and the arithmetic alone
  (every layer summed and cast, nothing written) tell the disk's share of the build
  from the arithmetic's: the build cannot beat the slower of the two. A virtual disk's
  speed swings from one moment to the next (up and down: a host cache can absorb one
  run's writes), so the five take turns, five rounds in an order that rotates (each
  runs once in every place, none always right after the same other), each after a
  sync of what the previous one left dirty. The ratio judged is the median over the
  rounds of the build against the same round's raw write, seconds apart; the best of
  each kind is compared beside it.
  The block device's own counters give each kind's average write request: a virtual
  disk's rate depends on it (up to the 4 MiB it takes at once), and a buffer of
  scattered 4 KiB pages cuts it to what one request can gather.
- start: from launching the process to ready (imports, load, merge from a cache hit,
  one pass over every weight) / the same for the base without LoRA (goal <= 1.05),
  page cache warm for both (every file dropped, then faulted in by an untimed first
  start of each kind through its own mapping); twelve rounds of one start of each kind,
  seconds apart, which goes first alternating. Judged: one plus what the hit adds after
  the imports both make (its import of lora_cache and its merge fall there; medians)
  over the base start's median, launch to ready: up to that point both run the same
  code, and a start's imports swing by ~0.3 s from one launch to the next, so the
  rounds' own ratios (shown beside it, with the best of each) measure mostly that.
  Both kinds run one full garbage collection at the same point (see ``_start``).
- first start: the same with an empty cache (the build included) / a start that merges
  with peft's ``merge_and_unload`` instead (goal <= 1.0), best of two each, taking
  turns; and the first start with one busy process per core / idle (goal <= 2.0).
- in place: the anonymous growth and the merge's time of the in-place path against
  peft's merge of the same model (goals: growth <= peft's + one layer, time <= peft's).
- the build's bound, the tightest of three measured in every round: the disk's (the raw
  write), judged at >= 0.8 of it; the CPU's (the CPU time the arithmetic alone and the
  write path alone took, every thread, over the cores: a build does both on the same
  cores, so where they are few the sum's bound is this, not the arithmetic alone's
  rate), judged at >= 0.9; and the arithmetic alone's rate (the chosen kernel, timed),
  the sum's bound where it leaves cores idle, judged at >= 0.9. Either way the median by
  round, against the same round's run. ``--build-only`` runs these rounds alone.

    flock /tmp/hostmem-bench.lock .venv/bin/python bench/bench_lora.py            # 4 GiB
    .venv/bin/python bench/bench_lora.py --quick                                   # 256 MiB smoke run
    .venv/bin/python bench/bench_lora.py --build-only --size 1GiB                  # the build's bound alone
    .venv/bin/python bench/bench_lora.py --start-only                              # hit start / base start alone
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import sys
import time

import torch  # noqa: F401  (imported before any clock, as a server has it)

from common import (  # noqa: E402 (sets sys.path)
    bench_args, child_scenario, drop_from_page_cache, format_size, report, stream_pass, workdir, write_lora_model,
)
from lora_baselines import first_starts, peft_start  # noqa: E402
from lora_summary import start_verdict, summarize, summarize_build  # noqa: E402

LAYERS = 48
COLS = 5120
RANK = 64
SHARDS = 4
ROUNDS = 5  # raw writes, the write path, the arithmetic and the build, in turn, in a rotating order
START_ROUNDS = 12  # timed rounds of one start of each kind: a start is ~1.5-2 s, its spread ~0.3 s, the goal 5%
BUILD_ONLY_ROUNDS = 3  # --build-only: a run in under two minutes at 1 GiB


def write_model(folder: str, size: int) -> tuple[list[str], str]:
    """A ``size``-byte bf16 checkpoint of LAYERS square-ish layers, and a rank-64 adapter (~3 bf16 steps)."""
    rows = max(64, size // (LAYERS * COLS * 2))
    return write_lora_model(folder, LAYERS, rows, COLS, RANK, "turbo-r64.safetensors", SHARDS)


# ----------------------------------------------------------------- scenarios (child processes)


def _load(shards: list[str], private: bool):
    from lora_cache.placement.layers import checkpoint_module, module_tree

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
    # without a root, the in-place path (the cache is on by default: it would build or hit
    # in the default root instead)
    with track_peak_anon() as peak:
        # rounding="merge": the baselines merge every layer, whatever share of an update rounds away
        stats = lora_cache.merge(model, [adapter], cache_root=root, base_files=shards, progress=False,
                                 enabled=root is not None, rounding="merge")
    return {"growth": peak.growth_bytes, "peak": peak.peak_bytes, "stats": stats.to_dict()}


def _start(shards, adapter, root) -> dict:
    """Load (+ merge from the cache) + one pass over the weights, then say when it was ready.

    The base start never imports lora_cache, as a server without LoRA would not. Both
    kinds run one full garbage collection at the same point, before the part after
    imports: Python collects every generation once the objects that survived collections
    since the last full one pass a quarter of those that survived it, and torch's import
    leaves the process a few thousand objects short of that mark, so without it
    whichever start allocated those first (the hit, importing lora_cache) paid ~90 ms
    for collecting torch's 170,000 objects, a cost a server pays at its next allocations
    either way. The full collections within each start's timed part are counted.
    """
    from hostmem.safetensors.mapping import load_readonly

    gc.collect()
    full_collections = gc.get_stats()[2]["collections"]
    started = time.perf_counter()
    named = [item for path in shards for item in load_readonly(path).items()]
    stats = None
    if adapter:
        import lora_cache
        from lora_cache.placement.layers import module_tree

        model = module_tree(named)
        stats = lora_cache.merge(model, [adapter], root, base_files=shards, progress=False, rounding="merge").to_dict()
        named = list(model.named_parameters())
    stream_pass([t for _, t in named])
    return {"ready_at": time.time(), "in_process_s": time.perf_counter() - started, "stats": stats,
            "full_collections": gc.get_stats()[2]["collections"] - full_collections}


def _raw_write(folder: str, nbytes: int, direct: bool, chunk: int = 64 << 20) -> dict:
    """Sequential write of ``nbytes`` (random data) to one file in ``folder``, then fsync.

    ``direct``: with O_DIRECT (the disk reads our buffer) into blocks allocated up front,
    from a buffer on huge pages (so each request is as large as the disk takes), as the
    cache writes; else through the page cache (what ``dd conv=fsync`` measures). Whatever
    the cache does to go faster, the baseline does too.
    """
    view = random_buffer(chunk)
    path = os.path.join(folder, "raw-write.bin")
    if direct:
        nbytes = -(-nbytes // 4096) * 4096  # O_DIRECT writes whole pages
    started = time.perf_counter()
    try:
        written = write_file(path, nbytes, view, direct)
    finally:
        seconds = time.perf_counter() - started
        os.unlink(path)
    return {"seconds": seconds, "bytes": written}


def random_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of random data on huge pages (so each O_DIRECT request is as large as the
    disk takes), touched before any clock starts."""
    from hostmem.safetensors.mapping import advise_huge_pages

    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    advise_huge_pages(buffer)
    buffer.write(os.urandom(nbytes))
    return memoryview(buffer)


def write_file(path: str, nbytes: int, view: memoryview, direct: bool, ready=None) -> int:
    """Write ``nbytes`` to a new ``path`` from ``view`` over and over, then fsync; with
    ``direct``, O_DIRECT into blocks allocated up front. ``ready`` (a barrier) is waited
    on once the file is open and allocated. Returns the bytes written."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if direct:
            os.posix_fallocate(fd, 0, nbytes)
        if ready is not None:
            ready.wait()
        written = 0
        while written < nbytes:
            written += os.pwrite(fd, view[: min(len(view), nbytes - written)], written)
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def _write_path(shards: list[str], root: str) -> dict:
    """The cache's write path alone: every base layer, copied into the merge's page-aligned
    output buffer (untimed, as the build's cast), put into a fresh combination, then sealed."""
    from hostmem.safetensors.mapping import load_readonly
    from lora_cache.compute.merge_math import Scratch
    from hostmem.vault import Vault

    named = [item for path in shards for item in load_readonly(path).items()]
    out = Scratch("cpu")
    seconds = cpu = written = 0
    session = Vault(root).open("0" * 64)  # a key of its own, removed before the next run
    for name, tensor in named:
        ready = out.take(tuple(tensor.shape), tensor.dtype).copy_(tensor)  # not timed: the build's cast
        started, used = time.perf_counter(), time.process_time()
        session.put(name, ready)
        seconds += time.perf_counter() - started
        cpu += time.process_time() - used
        written += tensor.numel() * tensor.element_size()
    started, used = time.perf_counter(), time.process_time()
    session.close()  # the manifest and the folder's fsync
    return {"seconds": seconds + time.perf_counter() - started, "bytes": written,
            "cpu_seconds": cpu + time.process_time() - used}


def _arithmetic(shards: list[str], adapter: str, root: str) -> dict:
    """The build's arithmetic alone: every layer summed in fp32 and cast into the output
    buffer as the build does it (same scratch, same block workers), nothing written."""
    from lora_cache.kernels import block_workers, plan_for_targets
    from lora_cache.placement.layers import checkpoint_module, compute_merged
    from lora_cache.compute.merge_math import Scratch
    from lora_cache.orchestrate import plan_targets

    targets, _ = plan_targets(checkpoint_module(shards), [adapter])
    plan = plan_for_targets(targets, "cpu", root)  # the build's own choice, from the same wisdom
    largest = max(t.nbytes for t in targets)
    work, out = Scratch("cpu"), Scratch("cpu")
    work.reserve(2 * largest)  # more than the fp32 blocks need
    out.reserve(largest)
    started, used = time.perf_counter(), time.process_time()
    with block_workers(work.device) as workers:
        for target in targets:
            base = target.current
            kernel = plan.kernel_for(tuple(base.shape), base.dtype, target.deltas, "cpu")
            compute_merged(target, out.take(tuple(base.shape), base.dtype), work, workers, kernel=kernel)
    return {"seconds": time.perf_counter() - started, "bytes": sum(t.nbytes for t in targets),
            "cpu_seconds": time.process_time() - used,
            "kernels": plan.describe() or "fp32-rows (no choice)", "wisdom": _wisdom(root)}


def _wisdom(root: str) -> dict:
    """The kernel timings the choice was made from (seconds per GiB, per class)."""
    from lora_cache.kernels import WISDOM_FILE

    try:
        with open(os.path.join(root, WISDOM_FILE)) as handle:
            return {json.loads(key)[4]: entry for key, entry in json.load(handle)["entries"].items()}
    except (OSError, ValueError, KeyError):
        return {}


def run_scenario(argv: list[str]) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    name, spec = argv[0], json.loads(argv[1])
    if name == "raw_write":
        result = _raw_write(spec["folder"], spec["bytes"], spec["direct"])
    elif name == "write_path":
        result = _write_path(spec["shards"], spec["root"])
    elif name == "arithmetic":
        result = _arithmetic(spec["shards"], spec["adapter"], spec["root"])
    elif name == "peft_start":
        result = peft_start(spec["shards"], spec["adapter"], RANK)
    elif name in ("in_place", "build"):
        result = _merge_measured(spec["shards"], spec["adapter"], spec.get("root"), spec.get("private", False))
    else:
        result = _start(spec["shards"], spec.get("adapter"), spec.get("root"))
    print(json.dumps(result))


# ----------------------------------------------------------------- the parent


def scenario(name: str, **spec) -> dict:
    return child_scenario(__file__, name, spec)


def disk_writes(folder: str) -> tuple[int, int] | None:
    """(write requests completed, bytes written) so far by the block device under ``folder``,
    from its /sys/dev/block/MAJ:MIN/stat; None where there is no such device (tmpfs, overlay)."""
    device = os.stat(folder).st_dev
    try:
        with open(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/stat") as handle:
            fields = handle.read().split()
    except OSError:
        return None
    return int(fields[4]), int(fields[6]) * 512  # writes completed, sectors written (always 512 B)


def _empty_cache(root: str) -> None:
    """Remove every combination under ``root``, keeping the memo of input digests: the
    build is then measured as every build after the first on a base runs (the first start
    on a new base also hashes the base, beside the build: ``bench_identity``'s folded
    start, and this bench's first start, which begins from an empty root)."""
    from hostmem.vault.store import MEMO_NAME

    cache = os.path.join(root, "lora_merge_cache")
    for entry in os.listdir(cache) if os.path.isdir(cache) else []:
        path = os.path.join(cache, entry)
        if entry == MEMO_NAME:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def build_rounds(shards: list[str], adapter: str, root: str, merged: int, rounds: int = ROUNDS) -> tuple[dict, dict]:
    """``rounds`` rounds of the raw writes, the write path, the arithmetic and the build, each in
    a fresh process on an empty cache: ``(runs by kind, the disk's average write request by kind)``."""
    runs = {"buffered": [], "direct": [], "write_path": [], "arithmetic": [], "build": []}
    kinds = list(runs)
    requests = {kind: [] for kind in kinds}  # the disk's average write request, bytes, per run
    for round_ in range(rounds):
        # Each kind in a new place each round; the last round is in the order above, so that
        # it ends with a build, whose combination the starts then hit.
        shift = (round_ + 1 - rounds) % len(kinds)
        for kind in kinds[shift:] + kinds[:shift]:
            _empty_cache(root)  # each starts empty, the base's digests known
            os.sync()  # nothing the previous run left dirty is written back during this one
            before = disk_writes(root)
            if kind == "build":
                run = scenario("build", shards=shards, adapter=adapter, root=root)
            elif kind == "write_path":
                run = scenario("write_path", shards=shards, root=root)
            elif kind == "arithmetic":
                run = scenario("arithmetic", shards=shards, adapter=adapter, root=root)
            else:
                run = scenario("raw_write", folder=root, bytes=merged, direct=kind == "direct")
            runs[kind].append(run)
            after = disk_writes(root)
            if before and after and after[0] > before[0]:
                requests[kind].append((after[1] - before[1]) / (after[0] - before[0]))
    return runs, requests


def start_rounds(shards: list[str], adapter: str, root: str) -> dict:
    """Starts without LoRA and with a cache hit, in turns, each in a fresh process: ``{kind:
    [(launch to ready, after imports), ...]}``, the first round untimed."""
    cache_files = [os.path.join(dp, f) for dp, _, fs in os.walk(root) for f in fs if f.endswith(".safetensors")]
    # Page cache warm for both, filled as a server's own first start fills it: each file
    # dropped, then one untimed start of each kind faults it in through its own mapping
    # (the first start after a build or a reboot reads from disk; it is not timed).
    drop_from_page_cache(shards + cache_files)
    starts = {"base": [], "hit": []}
    kinds = [("base", {}), ("hit", {"adapter": adapter, "root": root})]
    for round_ in range(1 + START_ROUNDS):
        for kind, extra in kinds if round_ % 2 else kinds[::-1]:  # which goes first alternates
            spawned = time.time()
            run = scenario("start", shards=shards, **extra)
            assert kind == "base" or run["stats"]["hit"] == LAYERS, run
            if round_:
                starts[kind].append({"total": run["ready_at"] - spawned, "after_imports": run["in_process_s"],
                                     "full_collections": run["full_collections"]})
    return starts


def summarize_starts(merged: int, starts: dict) -> None:
    """``--start-only``'s figures (:func:`lora_summary.start_verdict`)."""
    ratios, lines, figures = start_verdict(starts)
    report("bench_lora_start", [f"model: {format_size(merged)} bf16, {LAYERS} layers, rank-{RANK} adapter on every "
                                "layer", *lines], {"model_bytes": merged, **ratios, **figures})


def main() -> None:
    args = bench_args("LoRA merge cache vs in-place merge", default_size="4GiB", quick_size="256MiB", switches={
        "--build-only": "only the build rounds (build, raw writes, write path, arithmetic) and the build's bound",
        "--start-only": "only one build, then the starts: cache hit / without LoRA"})
    tmp = workdir(args)
    shards, adapter = write_model(args.workdir, args.size_bytes)
    merged = sum(os.path.getsize(s) for s in shards)
    root = os.path.join(args.workdir, "cache")
    os.makedirs(root, mode=0o700, exist_ok=True)
    if args.build_only:
        runs, requests = build_rounds(shards, adapter, root, merged, BUILD_ONLY_ROUNDS)
        summarize_build(merged, runs, requests, LAYERS, RANK, BUILD_ONLY_ROUNDS)
        if tmp is not None:
            tmp.cleanup()
        return
    if args.start_only:
        scenario("build", shards=shards, adapter=adapter, root=root)  # the combination the starts hit
        summarize_starts(merged, start_rounds(shards, adapter, root))
        if tmp is not None:
            tmp.cleanup()
        return
    in_place = scenario("in_place", shards=shards, adapter=adapter, private=True)
    assert in_place["stats"]["in_place"] == LAYERS and not in_place["stats"]["hit"], in_place["stats"]
    runs, requests = build_rounds(shards, adapter, root, merged)
    starts = start_rounds(shards, adapter, root)
    first = first_starts(scenario, shards, adapter, args.workdir)
    summarize(merged, in_place, runs, starts, requests, first, LAYERS, RANK, ROUNDS)
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--scenario":
        run_scenario(sys.argv[2:])
    else:
        main()
