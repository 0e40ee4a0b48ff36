"""Several ranks on one host: in-place merges against the LoRA merge cache's shared build.

Four ranks (torch.multiprocessing, a gloo process group on the CPU) load one synthetic
bf16 DiT (1 GiB by default) with a rank-64 adapter on every layer, as a multi-GPU server
runs one process per GPU. Side by side in one run:

- host memory: the non-reclaimable bytes of the four ranks together (measured by
  ``hostmem.aggregate_processes`` over their pids, a shared page once) while each holds
  its merged model, with in-place merges (the model loaded as servers load it, through
  safetensors' private mapping) against the cache (goal: the cache's under 1/4 of
  in-place's: every in-place rank holds its own anonymous copy, the cache's ranks map
  one set of files);
- first start: the wall time of the shared build (every rank calls ``lora_cache.merge``
  into an empty cache at once; the slowest rank counts) against one rank building alone
  into an empty cache (goal <= 0.6 on 2 cores). Each rank of the shared build sums its
  share on cores / ranks threads, at least 1 (``lora_cache.ranks.shared_build.rank_threads``),
  torch's own operations included: before, every rank started a worker per core and ran
  the adapter's finiteness check on torch's full OpenMP pool, so four ranks put four
  times the threads on the cores and the check alone stalled for seconds at OpenMP's
  barriers. How the ratio scales with cores: the build is the same bytes hashed, summed,
  checksummed and written whether one rank does it or four, so the bench measures both
  bounds beside it: the disk's (the same bytes written raw, by one writer and by four at
  once) and the CPU's (the rank alone's CPU time, every thread's, over the cores). No
  shared build goes below the larger of the two, however it splits the work; on 2 cores
  the rank alone already keeps both cores busy most of its time (its CPU time over 2 is
  about 0.8 of its wall time here), so the goal of 0.6 is out of reach there, and the
  ranks' own costs (four processes, four output buffers faulted in, their meetings)
  put the shared build above the rank alone. The bench splits the ratio: the sum is the
  slowest rank's own build (its ``MergeStats.seconds``: summing, checksumming and
  writing its share, and mapping), the overhead the rest of its wall time (hashing the
  inputs for the key, the ranks' meetings, waiting for the slowest share, sealing),
  each over one rank alone's wall time; the rank alone's own split is shown beside it.
  A rank alone folds the base's content hash into its build (``hostmem.vault.fold``);
  the ranks of a shared build hash the inputs together before the shares start, each a
  disjoint set of files, and fold the base's hash into their shares only where hashing
  first would leave cores idle (``lora_cache.ranks.fold.fold_pays``: here four shards
  and four ranks fill both cores, and folding measured slower). The ranks map the sealed
  combination at once, under the key's lock held shared. The sum's part falls once the
  ranks bring compute one rank alone leaves idle: a rank alone sums on at most 8
  workers (``MAX_WORKERS``), so on C cores it is about min(C, 8) / min(C, 8 R) of the
  disk-free sum (1 up to 8 cores, 0.25 with 4 ranks on 32 cores), and with a GPU per
  rank (``device=``) about 1 / R, until the disk's write rate is the bound.
  The non-reclaimable figures include each
  rank's own heap (torch, Python: about 150 MiB here), which the cache does not remove,
  so the memory ratio falls toward 0 as the model grows (from the figures at 256 MiB per
  rank, about 600 MiB of heaps for four ranks, it should meet its goal from about 512 MiB
  per rank).

The page cache of the checkpoint is warm for every scenario (read once first), and the
kernels are timed into each cache root before the clock starts (once per machine, not
per start: a server's root keeps the timings).

    .venv/bin/python bench/bench_shared_build.py                 # 4 ranks, 1 GiB
    .venv/bin/python bench/bench_shared_build.py --quick         # 64 MiB smoke run
    .venv/bin/python bench/bench_shared_build.py --profile       # where each rank spends the merge
    .venv/bin/python bench/bench_shared_build.py --base-known    # the inputs' digests already memoised
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys
import time

import torch.multiprocessing as mp

from common import bench_args, format_size, report, workdir  # noqa: E402 (sets sys.path)

RANKS = 4
KNOWN_HELP = ("the base and adapter already hashed into each cache root before the clock, as for a new combination "
              "on a checkpoint the server has used: the first start without the key's hashing")
PROFILE_HELP = ("only the rank alone and the shared build, each thread's Python stack sampled every millisecond: "
                "print where the rank alone and each rank spent the merge (the sampling slows them: no figures)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _host_non_reclaimable(dist, world: int) -> dict | None:
    """All ranks hold their merged models: rank 0 adds the ranks' memory up, a shared page once."""
    from hostmem import aggregate_processes

    pids: list = [None] * world
    dist.all_gather_object(pids, os.getpid())
    found = None
    if dist.get_rank() == 0:
        together = aggregate_processes(pids)
        found = {"non_reclaimable": together.totals.non_reclaimable, "precision": together.precision,
                 "file_backed": together.totals.file_backed, "summed_file_backed": together.summed.file_backed}
    dist.barrier()  # nobody lets go of its model before the figures are taken
    return found


def _profiled(profile: bool):
    """A :class:`StackSampler` with ``--profile``, else nothing."""
    import contextlib

    from stack_sampler import StackSampler

    return StackSampler() if profile else contextlib.nullcontext()


def _rank(rank: int, world: int, port: int, shards: list[str], adapter: str, folder: str, kind: str,
          profile: bool = False) -> None:
    """One rank: load, merge (in place or through the cache), measure, report to ``folder``."""
    import torch.distributed as dist

    import lora_cache
    from bench_lora import _load

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=1800))
    model = _load(shards, private=kind == "in_place")
    root = os.path.join(folder, "cache") if kind == "cache" else None
    _ready(model, adapter, root)
    dist.barrier()  # every rank starts its merge at once
    started = time.perf_counter()
    with _profiled(profile) as sampler:
        stats = lora_cache.merge(model, [adapter], cache_root=root, enabled=root is not None, base_files=shards,
                                 progress=False, rounding="merge")  # every layer built, whatever its rounding
    seconds = time.perf_counter() - started
    times: list = [None] * world
    dist.all_gather_object(times, (seconds, stats.seconds, sampler and sampler.report(
        f"rank {rank} of the shared build ({seconds:.2f} s)")))
    memory = _host_non_reclaimable(dist, world)
    if rank == 0:
        with open(os.path.join(folder, f"{kind}.json"), "w") as handle:
            json.dump({"seconds": max(t[0] for t in times), "build_seconds": max(t[1] for t in times),
                       "memory": memory, "built": stats.built, "hit": stats.hit, "layers": stats.layers,
                       "profiles": [t[2] for t in times]}, handle)
    dist.destroy_process_group()


def _ready(model, adapter: str, root: str | None) -> None:
    """Read the adapter and resolve its keys once, untimed: the imports this pulls in (and
    four ranks pulling them in at once on two cores) are not the build, alone or shared.
    With a cache ``root``, the kernels are timed into it too (kept there: once per
    machine, not per start, as bench_lora's first starts have them)."""
    from lora_cache.kernels import plan_for_targets
    from lora_cache.orchestrate import plan_targets

    targets, _ = plan_targets(model, [adapter])
    if root is not None:
        plan_for_targets(targets, "cpu", root)


def _alone(shards: list[str], adapter: str, folder: str, profile: bool = False) -> dict:
    """One rank building the same combination alone into an empty cache (its own process)."""
    ctx = mp.get_context("spawn")
    process = ctx.Process(target=_alone_child, args=(shards, adapter, folder, profile))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise SystemExit(f"the single-rank build failed (exit {process.exitcode})")
    with open(os.path.join(folder, "alone.json")) as handle:
        return json.load(handle)


def _alone_child(shards: list[str], adapter: str, folder: str, profile: bool) -> None:
    import lora_cache
    from bench_lora import _load

    model = _load(shards, private=False)
    root = os.path.join(folder, "cache")
    _ready(model, adapter, root)
    started, used = time.perf_counter(), time.process_time()
    with _profiled(profile) as sampler:
        stats = lora_cache.merge(model, [adapter], cache_root=root, base_files=shards, progress=False,
                                 rounding="merge")
    seconds = time.perf_counter() - started
    with open(os.path.join(folder, "alone.json"), "w") as handle:
        json.dump({"seconds": seconds, "build_seconds": stats.seconds,
                   "cpu_seconds": time.process_time() - used,  # every thread's CPU time
                   "profiles": [sampler and sampler.report(f"the rank alone ({seconds:.2f} s)")]}, handle)


def _ranks(kind: str, shards: list[str], adapter: str, folder: str, profile: bool = False) -> dict:
    os.makedirs(folder, exist_ok=True)
    mp.spawn(_rank, args=(RANKS, _free_port(), shards, adapter, folder, kind, profile), nprocs=RANKS, join=True)
    with open(os.path.join(folder, f"{kind}.json")) as handle:
        return json.load(handle)


def _raw_writes(folder: str, nbytes: int, writers: int) -> float:
    """Seconds for ``writers`` threads to write ``nbytes`` together (a share each, to a file
    each, O_DIRECT from huge pages, then fsync, as the cache writes): the disk's bound for
    a build of ``nbytes`` by that many ranks, whatever they compute."""
    import threading

    from bench_lora import random_buffer, write_file

    share = -(-nbytes // writers // 4096) * 4096
    view, start = random_buffer(64 << 20), threading.Barrier(writers + 1)

    def write(i: int) -> None:
        write_file(os.path.join(folder, f"raw-{i}.bin"), share, view, True, ready=start)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    start.wait()
    began = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - began
    for i in range(writers):
        os.unlink(os.path.join(folder, f"raw-{i}.bin"))
    return seconds


def _warm(paths: list[str]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(64 << 20):
                pass


def main() -> None:
    from bench_lora import write_model

    args = bench_args(__doc__.splitlines()[0], "1GiB", "64MiB", {"--profile": PROFILE_HELP, "--base-known": KNOWN_HELP})
    tmp = workdir(args)
    try:
        shards, adapter = write_model(args.workdir, args.size_bytes)
        _warm([*shards, adapter])
        if args.base_known:
            for scenario in ("alone", "shared"):
                _hash_into(os.path.join(args.workdir, scenario, "cache"), shards, adapter)
        if args.profile:
            alone = _alone(shards, adapter, os.path.join(args.workdir, "alone"), profile=True)
            shutil.rmtree(os.path.join(args.workdir, "alone"))
            cached = _ranks("cache", shards, adapter, os.path.join(args.workdir, "shared"), profile=True)
            print("\n\n".join(alone["profiles"] + cached["profiles"]))
            return
        in_place = _ranks("in_place", shards, adapter, os.path.join(args.workdir, "in-place"))
        disk = {"one": [], "all": []}
        disk["one"].append(_raw_writes(args.workdir, args.size_bytes, 1))
        alone = _alone(shards, adapter, os.path.join(args.workdir, "alone"))
        shutil.rmtree(os.path.join(args.workdir, "alone"))  # its disk space back before the shared build
        disk["all"].append(_raw_writes(args.workdir, args.size_bytes, RANKS))
        cached = _ranks("cache", shards, adapter, os.path.join(args.workdir, "shared"))
        disk["all"].append(_raw_writes(args.workdir, args.size_bytes, RANKS))
        disk["one"].append(_raw_writes(args.workdir, args.size_bytes, 1))
    finally:
        if tmp is not None:
            tmp.cleanup()
    _report(args.size_bytes, in_place, cached, alone, {k: min(v) for k, v in disk.items()}, args.base_known)


def _hash_into(root: str, shards: list[str], adapter: str) -> None:
    """The inputs' content digests memoised under ``root``, as a start that used them wrote
    them (hashed by a memo of its own: this process's would answer the second root from
    memory and write nothing there)."""
    from hostmem.vault import Vault, adapter_identity, base_identity
    from hostmem.vault.content_hash import ContentHashMemo

    memo, memo_file = ContentHashMemo(), Vault(root).memo_file
    base_identity(shards, memo_file=memo_file, memo=memo)
    adapter_identity(adapter, 1.0, None, memo_file=memo_file, memo=memo)


def _split(cached: dict, alone: dict) -> dict:
    """The first-start ratio as the sum's part plus the overhead's, each over the rank alone's
    wall time, and the rank alone's own split (see the module's docstring)."""
    wall = max(alone["seconds"], 1e-9)
    return {"ratio": cached["seconds"] / wall, "sum_part": cached["build_seconds"] / wall,
            "overhead_part": (cached["seconds"] - cached["build_seconds"]) / wall,
            "alone_sum_part": alone["build_seconds"] / wall,
            "alone_overhead_part": (alone["seconds"] - alone["build_seconds"]) / wall}


def _report(size: int, in_place: dict, cached: dict, alone: dict, disk: dict, base_known: bool = False) -> None:
    memory = cached["memory"]["non_reclaimable"] / max(1, in_place["memory"]["non_reclaimable"])
    split = _split(cached, alone)
    from lora_cache.kernels.workers import worker_count
    from lora_cache.ranks.shared_build import rank_threads

    cores, threads = len(os.sched_getaffinity(0)), rank_threads(RANKS)
    busy_shared, busy_alone = min(cores, RANKS * threads), min(cores, worker_count())
    lines = [
        f"{RANKS} ranks, {format_size(size)} merged per rank, {cores} cores",
        f"host non-reclaimable, in place: {format_size(in_place['memory']['non_reclaimable'])}; cache: "
        f"{format_size(cached['memory']['non_reclaimable'])} (file-backed, a shared page once: "
        f"{format_size(cached['memory']['file_backed'])}; each rank alone, summed: "
        f"{format_size(cached['memory']['summed_file_backed'])}); ratio {memory:.3f} (goal < 0.25)",
        f"first start{', the base already hashed' if base_known else ''}, shared build of {RANKS} ranks: "
        f"{cached['seconds']:.2f} s; one rank alone: {alone['seconds']:.2f} s; ratio {split['ratio']:.2f} "
        f"(goal <= 0.6 on 2 cores)",
        f"  of which the sum (the slowest rank's build of its share: {cached['build_seconds']:.2f} s, against "
        f"{alone['build_seconds']:.2f} s alone): {split['sum_part']:.2f}; the overhead (key, kernel plan, "
        f"meetings, waiting for the slowest share, seal, mapping: {cached['seconds'] - cached['build_seconds']:.2f} "
        f"s, against {alone['seconds'] - alone['build_seconds']:.2f} s alone): {split['overhead_part']:.2f} "
        f"(alone: {split['alone_sum_part']:.2f} + {split['alone_overhead_part']:.2f})",
        f"  the disk's bound: it writes {format_size(size)} in {disk['one']:.2f} s from one writer, "
        f"{disk['all']:.2f} s from {RANKS} at once (O_DIRECT, best of two each, beside the builds), so no "
        f"shared build of these bytes takes under {disk['all'] / max(alone['seconds'], 1e-9):.2f} of the rank "
        f"alone's time, whatever it computes; the rank alone took {alone['seconds'] / max(disk['one'], 1e-9):.2f}"
        f"x its own bound",
        f"  the CPU's bound: the rank alone's start took {alone['cpu_seconds']:.2f} core-seconds (hashing the "
        f"base, summing, checksumming, writing); the same work on {cores} cores takes at least "
        f"{alone['cpu_seconds'] / cores:.2f} s, {alone['cpu_seconds'] / cores / max(alone['seconds'], 1e-9):.2f} of "
        f"the rank alone's time, however it is shared",
        f"summing threads: {RANKS} ranks x {threads} in the shared build, {worker_count()} for the rank alone; "
        f"cores they keep busy: {busy_shared} against {busy_alone}, so by core count the sum's part would be about "
        f"{busy_alone / busy_shared:.2f} here (see the module's note for other core counts)",
    ]
    report("shared_build", lines, {
        "ranks": RANKS, "size_bytes": size, "cores": cores, "threads_per_rank": threads, "base_known": base_known,
        "threads_alone": worker_count(),
        "in_place_non_reclaimable_bytes": in_place["memory"]["non_reclaimable"],
        "cache_non_reclaimable_bytes": cached["memory"]["non_reclaimable"],
        "memory_ratio": memory, "shared_build_seconds": cached["seconds"], "alone_seconds": alone["seconds"],
        "shared_build_sum_seconds": cached["build_seconds"], "alone_sum_seconds": alone["build_seconds"],
        "first_start_ratio": split["ratio"], "first_start_sum_part": split["sum_part"],
        "first_start_overhead_part": split["overhead_part"], "built_by_rank0": cached["built"],
        "layers": cached["layers"], "precision": cached["memory"]["precision"],
        "raw_write_one_writer_seconds": disk["one"], "raw_write_all_ranks_seconds": disk["all"],
        "disk_bound_ratio": disk["all"] / max(alone["seconds"], 1e-9), "alone_cpu_seconds": alone["cpu_seconds"],
        "cpu_bound_ratio": alone["cpu_seconds"] / cores / max(alone["seconds"], 1e-9),
    })


if __name__ == "__main__":
    sys.exit(main())
