"""One measured run of a synthetic model, in a process of its own (``python -m planners.executor.trial``).

The executor's test and benchmark start this child so that the part measured runs
inside a memory cgroup, charged only for what it does there: the child imports torch,
computes the reference outputs from a fully loaded (anonymous) copy of the model,
maps the checkpoint read-only, drops the file's page cache, plans with ``room`` bytes
of page cache, and only then joins the group (``--join``) and runs ``--passes``
forward passes, under the executor or left to the kernel's own fault-driven reads
(``--mode kernel``), or with the model in page cache (``--mode cached``, no group:
the compute bound). It prints one JSON object: per pass seconds and disk bytes
(/proc/self/io), the group's counters after each pass, whether every output equals
the reference bit for bit, and what the executor measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

__all__ = ["main", "synthetic_config"]


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


def _rss_anon() -> int:
    from hostmem.procfs import read_status

    return read_status().rss_anon


def _run(args) -> dict:
    import torch

    from planners.executor import execute, read_io_bytes
    from planners.executor.cgroup_stat import cgroup_counters
    from planners.executor.synthetic import load_synthetic_dit
    from planners.startup import plan_loaded

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(args.tokens, 64, generator=gen) for _ in range(args.passes)]
    reference = _reference(args.checkpoint, inputs) if args.check else None
    model = load_synthetic_dit(args.checkpoint, args.loader)
    inputs = [x.to(model.head.weight.dtype) for x in inputs]
    if args.mode == "cached":
        with torch.no_grad():
            model(inputs[0])  # every page in cache and mapped
    else:
        _drop_file(args.checkpoint)
    anon = _rss_anon()
    config = synthetic_config(args.checkpoint, anon + args.slack + args.room, anon + args.slack, args.max_pinned,
                              args.passes)
    plan = plan_loaded(config, {"dit": model})
    planned_kept = list(plan.pins.plans["dit"].kept_layers)
    version = 2 if args.join and os.path.exists(os.path.join(args.join, "memory.current")) else 1
    if args.join:
        with open(os.path.join(args.join, "cgroup.procs"), "w") as handle:
            handle.write(str(os.getpid()))
    anon_joined = _rss_anon()
    ex = execute(plan, {"dit": model}, prefetch=args.prefetch, read_ahead=args.read_ahead,
                 disk_read=config.transfer.disk_read) if args.mode == "executor" else None
    passes, identical = [], True
    with torch.no_grad():
        began = time.perf_counter()
        if ex is not None:
            ex.__enter__()  # pins, hooks, the reader's choice: what a server waits for at start
        start_s = time.perf_counter() - began
        try:
            for i, x in enumerate(inputs):
                read0, t0 = read_io_bytes(), time.perf_counter()
                out = model(x)
                seconds, read = time.perf_counter() - t0, read_io_bytes() - read0
                entry = {"seconds": seconds, "read_bytes": read, "rss_anon": _rss_anon()}
                if args.join:
                    entry["cgroup"] = cgroup_counters(args.join, version)
                passes.append(entry)
                if reference is not None:
                    identical = identical and torch.equal(out, reference[i])
            stats = ex.stats().to_dict() if ex is not None else None
        finally:
            if ex is not None:
                ex.close()
    hooks_left = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return {
        "mode": args.mode, "passes": passes, "identical": identical if reference is not None else None,
        "model_bytes": os.path.getsize(args.checkpoint), "anon_before": anon_joined,
        "kept_bytes": stats["kept_bytes"]["dit"] if stats else 0,
        "predicted_read_bytes": stats["predicted_read_bytes"]["dit"] if stats else None,
        "largest_layer": max(p.numel() * p.element_size() for p in model.blocks.parameters()),
        "executor": stats, "hooks_left": hooks_left, "planned_kept": planned_kept,
        "kept": list(ex.roles["dit"].kept) if ex is not None else None, "loader": args.loader, "start_s": start_s,
        "pinned_bytes": plan.pins.pinned_bytes, "window_bytes": plan.pins.window_bytes,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planners.executor.trial", description=__doc__)
    parser.add_argument("checkpoint")
    parser.add_argument("--mode", choices=("executor", "kernel", "cached"), default="executor")
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
    args = parser.parse_args(argv)
    json.dump(_run(args), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
