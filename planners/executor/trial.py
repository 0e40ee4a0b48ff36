"""One measured run of a synthetic model, in a process of its own (``python -m planners.executor.trial``).

The executor's test and benchmark start this child so that the part measured runs
inside a memory cgroup, charged only for what it does there: the child imports torch,
computes the reference outputs from a fully loaded (anonymous) copy of the model,
maps the checkpoint read-only, drops the file's page cache, plans with ``room`` bytes
of page cache, and only then joins the group (``--join``) and runs ``--passes``
forward passes, under the executor or left to the kernel's own fault-driven reads
(``--mode kernel``), or with the model in page cache (``--mode cached``, no group:
the compute bound). The other ways to offload (``--mode group``, ``disk``, ``whole``:
:mod:`planners.executor.offload_ways`) set up in place of the plan, their copies on
disk in a folder beside the checkpoint, removed at the end. It prints one JSON object:
per pass seconds, the CPU seconds of the thread that ran it and disk bytes
(/proc/self/io), the group's counters after each pass, whether every output equals
the reference bit for bit (``--check``: every pass against the fully loaded copy;
``--check-first``: the first against a plain run of the mapped model), the first
output's digest, the seconds from a loaded model to the first pass, and what the
executor measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

__all__ = ["main", "synthetic_config", "EXECUTOR_MODES", "OFFLOAD_MODES"]

EXECUTOR_MODES = ("executor", "kernel", "cached")
OFFLOAD_MODES = ("group", "disk", "whole")  # planners.executor.offload_ways.WAYS


def synthetic_config(checkpoint: str, limit: int, reserve: int, max_pinned: int | str, steps: int):
    """A deployment of the synthetic model alone on a host of ``limit`` bytes (``max_pinned``:
    bytes, or a share of the limit such as ``"75%"``)."""
    from planners.config import parse_config

    pinned = max_pinned if isinstance(max_pinned, str) else f"{max_pinned}B"
    text = (
        "deployment: executor-trial\n"
        f"host: {{limit: {limit}B, reserve: {reserve}B, max_pinned: {pinned}}}\n"
        f"workload: {{steps: {steps}}}\n"
        "components:\n"
        f"  dit: {{path: {json.dumps(checkpoint)}, layers: \"blocks.{{i}}.\", offload: layerwise}}\n"
    )
    return parse_config(text, os.path.join(os.path.dirname(checkpoint), "trial.yaml"), environ={})


def _drop_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _reference(checkpoint, inputs):
    import torch

    from hostmem.safetensors.mapping import load_readonly
    from planners.executor.synthetic import SyntheticDiT

    tensors = {k: v.clone() for k, v in load_readonly(checkpoint).items()}  # fully loaded: anonymous
    layers = sum(1 for k in tensors if k.startswith("blocks."))
    model = SyntheticDiT(layers, tensors["head.weight"].shape[1], tensors["head.weight"].dtype).requires_grad_(False)
    model.load_state_dict(tensors, assign=True)
    with torch.no_grad():
        return [model(x.to(model.head.weight.dtype)) for x in inputs]


def _first_reference(checkpoint, loader, x):
    """The first pass's output from a plain run of the mapped model, on a mapping of its own that
    is gone on return (a page still mapped would stay cached through the drop that follows)."""
    import gc

    import torch

    from planners.executor.synthetic import load_synthetic_dit

    model = load_synthetic_dit(checkpoint, loader)
    with torch.no_grad():
        out = model(x.to(model.head.weight.dtype))
    del model
    gc.collect()
    return [out]


def _rss_anon() -> int:
    from hostmem.procfs import read_status

    return read_status().rss_anon


def _output_digest(out) -> str:
    """A pass's output as a digest, so that the parent can compare ways run in other processes."""
    import hashlib

    return hashlib.sha256(out.float().contiguous().numpy().tobytes()).hexdigest()


def _prepare(args, model, folder):
    """What a way does between a loaded model and its first pass, before the child joins its
    group: the plan (executor modes), else the offloader's setup (its copies written, their page
    cache then dropped). Returns (plan, config, seconds of setup, bytes of the way's copies on disk)."""
    from planners.executor.offload_ways import apply_way, drop_folder_cache
    from planners.startup import plan_loaded

    plan = config = None
    began = time.perf_counter()
    if args.mode in OFFLOAD_MODES:
        apply_way(args.mode, model, folder)
        seconds = time.perf_counter() - began
        return plan, config, seconds, drop_folder_cache(folder)
    anon = _rss_anon()
    config = synthetic_config(args.checkpoint, anon + args.slack + args.room, anon + args.slack, args.max_pinned,
                              args.passes)
    plan = plan_loaded(config, {"dit": model})
    return plan, config, time.perf_counter() - began, 0


def _join(group: str | None) -> int | None:
    """Move this process into ``group``; returns the group's cgroup version (None: no group)."""
    if not group:
        return None
    with open(os.path.join(group, "cgroup.procs"), "w") as handle:
        handle.write(str(os.getpid()))
    return 2 if os.path.exists(os.path.join(group, "memory.current")) else 1


def _passes(args, model, inputs, ex, version, reference) -> tuple[list, bool, str, float]:
    """Run the measured passes; returns each pass's figures, whether every output checked equals
    its reference, the first output's digest and the seconds the executor took to start."""
    import torch

    from planners.executor import read_io_bytes
    from planners.executor.cgroup_stat import cgroup_counters

    passes, identical, digest = [], True, ""
    with torch.no_grad():
        began = time.perf_counter()
        if ex is not None:
            ex.__enter__()  # pins, hooks, the reader's choice: what a server waits for at start
        start_s = time.perf_counter() - began
        for i, x in enumerate(inputs):
            read0, t0, c0 = read_io_bytes(), time.perf_counter(), time.thread_time()
            out = model(x)
            seconds, read = time.perf_counter() - t0, read_io_bytes() - read0
            entry = {"seconds": seconds, "cpu_seconds": time.thread_time() - c0, "read_bytes": read,
                     "rss_anon": _rss_anon()}
            if version is not None:
                entry["cgroup"] = cgroup_counters(args.join, version)
            passes.append(entry)
            digest = digest or _output_digest(out)
            if i < len(reference):
                identical = identical and torch.equal(out, reference[i])
    return passes, identical, digest, start_s


def _run(args, folder: str | None) -> dict:
    import torch

    from planners.executor import execute
    from planners.executor.offload_ways import load_whole
    from planners.executor.synthetic import load_synthetic_dit

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(args.tokens, 64, generator=gen) for _ in range(args.passes)]
    reference = _reference(args.checkpoint, inputs) if args.check else []
    if args.check_first and not reference:
        reference = _first_reference(args.checkpoint, args.loader, inputs[0])
    model = load_synthetic_dit(args.checkpoint, args.loader)
    inputs = [x.to(model.head.weight.dtype) for x in inputs]
    if args.mode == "cached":
        with torch.no_grad():
            model(inputs[0])  # every page in cache and mapped
    else:
        _drop_file(args.checkpoint)
    largest = max(p.numel() * p.element_size() for p in model.blocks.parameters())
    plan, config, setup_s, copy_bytes = _prepare(args, model, folder)
    version = _join(args.join)
    anon_joined = _rss_anon()
    if args.mode == "whole":
        began = time.perf_counter()
        load_whole(model)  # inside the group: what it is charged for
        setup_s = time.perf_counter() - began
    ex = execute(plan, {"dit": model}, prefetch=args.prefetch, read_ahead=args.read_ahead,
                 disk_read=config.transfer.disk_read) if args.mode == "executor" else None
    try:
        passes, identical, digest, start_s = _passes(args, model, inputs, ex, version, reference)
        stats = ex.stats().to_dict() if ex is not None else None
    finally:
        if ex is not None:
            ex.close()
    hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return {
        "mode": args.mode, "passes": passes, "identical": identical if reference else None, "first_output": digest,
        "model_bytes": os.path.getsize(args.checkpoint), "anon_before": anon_joined,
        "kept_bytes": stats["kept_bytes"]["dit"] if stats else 0,
        "predicted_read_bytes": stats["predicted_read_bytes"]["dit"] if stats else None,
        "largest_layer": largest, "executor": stats, "hooks_left": hooks_left,
        "planned_kept": list(plan.pins.plans["dit"].kept_layers) if plan else None,
        "kept": list(ex.roles["dit"].kept) if ex is not None else None, "loader": args.loader, "start_s": start_s,
        "setup_s": setup_s, "copy_bytes": copy_bytes, "pinned_bytes": plan.pins.pinned_bytes if plan else 0,
        "window_bytes": plan.pins.window_bytes if plan else 0,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planners.executor.trial", description=__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--mode", choices=EXECUTOR_MODES + OFFLOAD_MODES, default="executor",
                        help="the executor, the kernel alone, the model in page cache, or another way to offload "
                        "(planners.executor.offload_ways)")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--room", type=int, required=True, help="page cache the plan may use, bytes")
    parser.add_argument("--slack", type=int, default=8 << 20, help="reserve beyond the process's anonymous memory")
    parser.add_argument("--max-pinned", default="0B", help="bytes (\"123B\") or a share of the limit (\"75%%\")")
    parser.add_argument("--loader", choices=("hostmem", "safetensors"), default="hostmem",
                        help="map the checkpoint with hostmem (read-only, shared) or safetensors.torch.load_file")
    parser.add_argument("--join", help="a memory cgroup folder to join before the measured passes")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--prefetch", type=int, default=None, help="layers read ahead (default: the plan's)")
    parser.add_argument("--read-ahead", default="auto")
    parser.add_argument("--check", action="store_true", help="compare outputs with a fully loaded copy")
    parser.add_argument("--check-first", action="store_true",
                        help="compare the first pass's output with a plain run of the mapped model")
    args = parser.parse_args(argv)
    folder = None
    if args.mode in OFFLOAD_MODES:  # the way's copies on disk, beside the checkpoint (the same disk)
        folder = tempfile.mkdtemp(prefix=f"offload-{args.mode}-", dir=os.path.dirname(os.path.abspath(args.checkpoint)))
    try:
        json.dump(_run(args, folder), sys.stdout)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
